"""Where the FP8 experts' time goes: ``python -m fxoverlap.bench fp8 --parts profile``.

One experts layer's work (``GroupedExperts`` under ``ops.expert_rows``) at the Qwen3-30B-A3B shape of
one emulated EP-8 rank (4096 tokens x top-8 = 32768 rows over 16 local experts, dim 2048, expert dim
768), run eager phase by phase with the ops the traced experts stages call: the forward (gate and up
grouped GEMMs, SiLU * mul, down grouped GEMM), the input gradient (the same ops on ``(dy, w^T)``,
SwiGLU's backward) and the weight gradients (the wgrad op, which ``delay_wgrad`` moves). Once with
bf16's ops (``fxoverlap::grouped_mm`` / ``grouped_mm_wgrad``, no padding) and once with FP8's
(``fxoverlap::grouped_mm_fp8`` / ``grouped_mm_fp8_wgrad``, each group padded to 16 rows).

For each variant and phase: the time (CUDA events, median; on the CPU the wall clock), the device
kernels of a ``torch.profiler`` run of that phase alone (on the CPU its ops' self time) by name and by
category (:func:`category`); and each FP8 building block of ``kernels/fp8_gemm.py`` timed alone on the
arguments the layer gave it, with its calls per layer (so: "quantize_rhs X us x 6 calls of Y"). On
the CPU it runs the reference math at any size: the test's smoke (``tests/test_fp8.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import statistics
import time
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from fxoverlap import fp8_ops, ops
from fxoverlap.bench.gpu_dp import sync
from fxoverlap.bench.gpu_fp8 import _counts, sqnr
from fxoverlap.ir.errors import FxOverlapError
from fxoverlap.kernels import fp8_gemm, grouped_gemm


class ProfileShapeError(FxOverlapError, ValueError):
    """The profiled shape cannot be made: too few rows for the groups."""


PHASES = ("fwd", "dgrad", "wgrad")
CATEGORIES = ("quantize", "gemm", "copy", "elementwise", "other")
# the fp8_gemm functions timed alone (each called by the FP8 ops; _col_major only on the CPU path)
FP8_BLOCKS = ("quantize_rows", "quantize_rhs", "_quantize_group_pair", "scaled_grouped_mm", "_col_major")
NESTED = ("_col_major",)  # called inside another block: not added to the blocks' sum
BF16_BLOCKS = ("grouped_mm", "grouped_mm_wgrad")

# Categories by kernel (or, on the CPU, aten op) name, first match wins: GEMMs before quantization
# (a scaled GEMM's CUTLASS name mentions its FP8 types), copies before elementwise (a copy is an
# elementwise kernel of a copy functor).
_RULES = (
    ("gemm", re.compile(r"gemm|cutlass|nvjet|cublas|xmma|wgmma|matmul|_grouped_mm|(^|[^a-z])(b|add)?mm([^a-z]|$)")),
    ("quantize", re.compile(r"fp8|float8|e4m3|scale|amax|reciprocal|quant|log2|exp2|floor|clamp")),
    ("copy", re.compile(r"copy|memcpy|memset|contiguous|transpose|pad|index|cat([^a-z]|$)|fill|zero|scatter|gather"
                        r"|where|_to_copy|clone|empty|searchsorted|repeat")),
    ("elementwise", re.compile(r"elementwise|silu|sigmoid|mul|add|sub|div|neg|abs|reduce|cumsum|scan|diff")),
)


def category(name: str) -> str:
    """One of :data:`CATEGORIES` for a kernel (or CPU op) name."""
    n = name.lower()
    for cat, rule in _RULES:
        if rule.search(n):
            return cat
    return "other"


@dataclasses.dataclass(frozen=True)
class Variant:
    """An experts stage's ops: the grouped GEMM (forward, and input gradient on ``(dy, w^T)``),
    its weight gradient, and the row alignment ``ops.expert_rows`` pads each group to."""

    name: str
    mm: Callable[..., torch.Tensor]
    wgrad: Callable[..., torch.Tensor]
    row_align: int
    expert_dtype: str | None


VARIANTS = {
    "bf16": Variant("bf16", torch.ops.fxoverlap.grouped_mm.default, ops.GROUPED_MM_WGRAD_OP, 1, None),
    "fp8": Variant("fp8", fp8_ops.GROUPED_MM_FP8_OP, fp8_ops.GROUPED_MM_FP8_WGRAD_OP, fp8_ops.ROW_ALIGN,
                   "fp8_rowwise"),
}


# ---------------------------------------------------------------- one experts layer, phase by phase


def forward(v: Variant, x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
            w2: torch.Tensor) -> dict:
    """``ops.expert_rows(GroupedExperts, x, counts)``'s forward; returns what the backward saves."""
    if v.row_align > 1:
        p = ops.pad_groups(x, counts, v.row_align)
        xp, sizes, padded = p.x, p.tokens_per_expert, p
    else:
        xp, sizes, padded = x, counts, None
    offs = torch.cumsum(sizes, 0).to(torch.int32)
    h1 = v.mm(xp, w1, offs)
    a = F.silu(h1)
    h3 = v.mm(xp, w3, offs)
    h = a * h3
    y = v.mm(h, w2, offs)
    out = y if padded is None else ops.unpad_groups(y, padded)
    return {"out": out, "xp": xp, "offs": offs, "padded": padded, "h1": h1, "a": a, "h3": h3, "h": h}


def input_grad(v: Variant, s: dict, dy: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
               w2: torch.Tensor) -> dict:
    """The input gradient as autograd runs it (unpad's and SwiGLU's backward, the grouped GEMM op on
    ``(dy, w^T)``); returns ``dx`` and what the weight gradients read."""
    padded, offs = s["padded"], s["offs"]
    if padded is not None:  # unpad's backward: index_copy's, a gather
        dy = F.pad(dy, (0, 0, 0, 1)).index_select(0, padded.source)
    dy = dy.contiguous()
    dh = v.mm(dy, w2.transpose(-1, -2), offs)
    dh3 = (dh * s["a"]).contiguous()  # mul's backward, then SiLU's (what autograd runs)
    dh1 = torch.ops.aten.silu_backward(dh * s["h3"], s["h1"]).contiguous()
    dxp = v.mm(dh1, w1.transpose(-1, -2), offs) + v.mm(dh3, w3.transpose(-1, -2), offs)
    dx = dxp if padded is None else dxp.index_select(0, padded.index)  # index_copy's backward (pad_groups)
    return {"dx": dx, "dyp": dy, "dh1": dh1, "dh3": dh3}


def weight_grad(v: Variant, s: dict, g: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dw1, dw3, dw2)``: the wgrad op on the forward's inputs and the backward's output gradients."""
    return (v.wgrad(s["xp"], g["dh1"], s["offs"]), v.wgrad(s["xp"], g["dh3"], s["offs"]),
            v.wgrad(s["h"], g["dyp"], s["offs"]))


def uneven_counts(rows: int, groups: int, seed: int = 0) -> torch.Tensor:
    """Uneven group sizes summing to ``rows`` (``gpu_fp8._counts``'), none empty and none a
    multiple of 16, so the padding to 16 runs as it does on routed tokens."""
    align = fp8_ops.ROW_ALIGN
    c = _counts(rows, groups, seed)
    big = int(c.argmax())
    extra = torch.randint(1, align, (groups,), generator=torch.Generator().manual_seed(seed + 1))
    extra[big] = -(int(extra.sum()) - int(extra[big]))  # the largest group gives the rows
    c = c + extra
    if int(c[big]) % align == 0:  # one row more to a group that stays unaligned
        i = next(i for i in range(groups) if i != big and int(c[i]) % align != align - 1)
        c[i] += 1
        c[big] -= 1
    if int(c.min()) <= 0:
        raise ProfileShapeError(f"fp8 profile: {rows} rows are too few for {groups} groups of uneven sizes; "
                                f"give more rows or fewer groups")
    return c


# ---------------------------------------------------------------- timing and profiling


def time_us(fn: Callable[[], object], device: torch.device, warmup: int, iters: int, reps: int = 1) -> float:
    """Median µs of one ``fn()`` over ``iters`` samples of ``reps`` calls: CUDA events on a GPU
    (queued back to back, one sync at the end), the wall clock elsewhere."""
    for _ in range(warmup):
        fn()
    sync(device)
    if device.type == "cuda":
        marks = []
        for _ in range(iters):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(reps):
                fn()
            b.record()
            marks.append((a, b))
        torch.cuda.synchronize(device)
        samples = [a.elapsed_time(b) * 1e3 / reps for a, b in marks]
    else:
        samples = []
        for _ in range(iters):
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            samples.append((time.perf_counter() - t0) * 1e6 / reps)
    return statistics.median(samples)


def profile_kernels(fn: Callable[[], object], device: torch.device, iters: int) -> dict[str, list[float]]:
    """``{name: [µs per fn(), calls per fn()]}`` of the device kernels (memcpy/memset included) of
    ``iters`` calls of ``fn`` under ``torch.profiler``; on the CPU, every op's self CPU time."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync(device)
    with profile(activities=acts) as prof:
        for _ in range(iters):
            fn()
        sync(device)
    agg: dict[str, list[float]] = {}
    for e in prof.events():
        if getattr(e, "is_user_annotation", False):  # record_function ranges (ours or torch's)
            continue
        if cuda:
            if e.device_type != DeviceType.CUDA:
                continue
            us = e.time_range.elapsed_us()
        else:
            if e.device_type != DeviceType.CPU:
                continue
            us = e.self_cpu_time_total
        row = agg.setdefault(e.name, [0.0, 0.0])
        row[0] += us / iters
        row[1] += 1 / iters
    return agg


def _by_category(kernels: dict[str, list[float]]) -> dict[str, float]:
    out = dict.fromkeys(CATEGORIES, 0.0)
    for name, (us, _) in kernels.items():
        out[category(name)] += us
    return {k: round(v, 1) for k, v in out.items()}


def _sig(a: object) -> str:
    if isinstance(a, torch.Tensor):
        dt = {torch.bfloat16: "bf16", torch.float32: "f32", torch.float8_e4m3fn: "e4m3", torch.int32: "i32",
              torch.int64: "i64"}.get(a.dtype, str(a.dtype).replace("torch.", ""))
        layout = "" if a.is_contiguous() or a.dim() < 2 else "^T"
        return f"{dt}[{','.join(map(str, a.shape))}]{layout}"
    return repr(a)


@contextlib.contextmanager
def record_calls(module: object, names: tuple[str, ...], log: list) -> Iterator[None]:
    """Every call of ``module.<name>`` appended to ``log`` as ``(name, fn, args, kwargs)`` (the
    modules call these through their globals, so a patched attribute sees them)."""
    saved = {n: getattr(module, n) for n in names}

    def wrap(name: str, fn: Callable) -> Callable:
        def recorded(*args, **kwargs):
            log.append((name, fn, args, kwargs))
            return fn(*args, **kwargs)
        return recorded

    for n, fn in saved.items():
        setattr(module, n, wrap(n, fn))
    try:
        yield
    finally:
        for n, fn in saved.items():
            setattr(module, n, fn)


def _blocks_of(log: list, timer: Callable[[Callable[[], object]], float], variant: str) -> list[dict]:
    """Each distinct call (function and argument shapes) of ``log``, timed alone, with its calls per layer."""
    seen: dict[tuple, dict] = {}
    for name, fn, args, kwargs in log:
        key = (name, tuple(_sig(a) for a in args))
        if key in seen:
            seen[key]["calls"] += 1
            continue
        seen[key] = {"variant": variant, "block": name, "args": ", ".join(key[1]), "calls": 1,
                     "_run": (lambda fn=fn, args=args, kwargs=kwargs: fn(*args, **kwargs))}
    rows = []
    for row in seen.values():
        row["us"] = round(timer(row.pop("_run")), 2)
        rows.append(row)
    return rows


# ---------------------------------------------------------------- the part


def profile(device: str = "cuda", rows: int = 4096 * 8, groups: int = 16, dim: int = 2048, expert_dim: int = 768,
            warmup: int = 3, iters: int = 20, profile_iters: int = 3, reps: int = 5, top: int = 30,
            seed: int = 0, printout: bool = True) -> dict:
    """The ``profile`` part's JSON (see the module docstring). Defaults: one emulated EP-8 rank of the
    Qwen3-30B-A3B layer (4096 tokens x top-8 rows, 16 local experts)."""
    from fxoverlap.models.moe import GroupedExperts

    dev = torch.device(device)
    torch.manual_seed(seed)
    experts = GroupedExperts(groups, dim, expert_dim).to(dev, torch.bfloat16)
    w1, w3, w2 = (p.detach() for p in (experts.w1, experts.w3, experts.w2))
    counts = uneven_counts(rows, groups, seed).to(dev)
    x = torch.randn(rows, dim, device=dev, dtype=torch.bfloat16)
    dy = torch.randn(rows, dim, device=dev, dtype=torch.bfloat16)
    cuda = dev.type == "cuda"
    timer = (lambda fn: time_us(fn, dev, warmup, iters))
    block_timer = (lambda fn: time_us(fn, dev, warmup, iters, reps))
    res: dict = {
        "shape": {"rows": rows, "groups": groups, "dim": dim, "expert_dim": expert_dim, "counts": counts.tolist(),
                  "gemms": f"x[rows,{dim}] @ w1,w3[{groups},{dim},{expert_dim}]; h @ w2[{groups},{expert_dim},{dim}]"},
        "device": torch.cuda.get_device_name(dev) if cuda else "cpu",
        "timer": "cuda_events" if cuda else "wall", "iters": iters, "profile_iters": profile_iters,
        "kernels_are": "device kernels (us per layer)" if cuda else "CPU ops' self time (us per layer)",
        "phases_us": {}, "busy_us": {}, "categories": {}, "kernels": {}, "blocks": [],
    }
    outputs = {}
    for name, v in VARIANTS.items():
        s = forward(v, x, counts, w1, w3, w2)
        g = input_grad(v, s, dy, w1, w3, w2)
        dw = weight_grad(v, s, g)
        outputs[name] = (s["out"], g["dx"], dw)
        run = {"fwd": lambda v=v: forward(v, x, counts, w1, w3, w2),
               "dgrad": lambda v=v, s=s: input_grad(v, s, dy, w1, w3, w2),
               "wgrad": lambda v=v, s=s, g=g: weight_grad(v, s, g)}
        t = {p: round(timer(run[p]), 1) for p in PHASES}
        t["total"] = round(sum(t.values()), 1)

        def layer(v=v):
            s1 = forward(v, x, counts, w1, w3, w2)
            return weight_grad(v, s1, input_grad(v, s1, dy, w1, w3, w2))
        t["layer_at_once"] = round(timer(layer), 1)
        res["phases_us"][name] = t
        try:
            kern = {p: profile_kernels(run[p], dev, profile_iters) for p in PHASES}
        except Exception as e:  # noqa: BLE001  (the times and blocks still say much: keep them)
            res.setdefault("profiler_error", {})[name] = f"{type(e).__name__}: {str(e)[:300]}"
            kern = {p: {} for p in PHASES}
        res["busy_us"][name] = {p: round(sum(us for us, _ in kern[p].values()), 1) for p in PHASES}
        res["categories"][name] = {p: _by_category(kern[p]) for p in PHASES}
        merged: dict[str, dict] = {}
        for p in PHASES:
            for k, (us, calls) in kern[p].items():
                row = merged.setdefault(k, {"name": k[:160], "cat": category(k), "us": 0.0, "calls": 0.0})
                row["us"] += us
                row["calls"] += calls
                row[p] = round(us, 1)
        total = sum(r["us"] for r in merged.values()) or 1.0
        table = sorted(merged.values(), key=lambda r: -r["us"])[:top]
        for r in table:
            r["share"] = round(r["us"] / total, 4)
            r["us"], r["calls"] = round(r["us"], 1), round(r["calls"], 2)
        res["kernels"][name] = table
        # the building blocks: each distinct call the layer makes, timed alone on its own arguments
        log: list = []
        if name == "fp8":
            with record_calls(fp8_gemm, FP8_BLOCKS + ("grouped_mm_wgrad",), log):
                layer()
            res["blocks"] += _blocks_of([c for c in log if c[0] != "grouped_mm_wgrad"], block_timer, name)
            res["blocks"] += _fp8_extra_blocks(log, s, g, x, counts, w1, cuda, block_timer)
        else:
            with record_calls(grouped_gemm, BF16_BLOCKS, log):
                layer()
            res["blocks"] += _blocks_of(log, block_timer, name)
    for b in res["blocks"]:
        b["us_per_layer"] = round(b["us"] * b["calls"], 1)
    res["blocks"].sort(key=lambda b: (b["variant"], -b["us_per_layer"]))
    res["blocks_sum_us"] = {n: round(sum(b["us_per_layer"] for b in res["blocks"]
                                         if b["variant"] == n and b["block"] not in NESTED), 1) for n in VARIANTS}
    b16, f8 = res["phases_us"]["bf16"], res["phases_us"]["fp8"]
    res["fp8_over_bf16"] = {p: round(f8[p] / b16[p], 3) if b16[p] else None for p in (*PHASES, "total")}
    (y0, dx0, dw0), (y1, dx1, dw1) = outputs["bf16"], outputs["fp8"]
    res["sqnr_db"] = {"out": round(sqnr(y0, y1), 2), "dx": round(sqnr(dx0, dx1), 2),
                      "dw": round(min(sqnr(a, b) for a, b in zip(dw0, dw1)), 2)}
    res["summary"] = summary(res)
    if printout:
        print("\n".join(res["summary"]), flush=True)
    return res


def _fp8_extra_blocks(log: list, s: dict, g: dict, x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor,
                      cuda: bool, timer: Callable[[Callable[[], object]], float]) -> list[dict]:
    """The FP8 layer's work outside the fp8_gemm functions: ``ops.expert_rows``' padding (forward and
    backward), and ``grouped_mm_wgrad``'s row pad and its ``torch.where`` on empty groups."""
    wgrads = [args for name, _, args, _ in log if name == "grouped_mm_wgrad"]
    align = fp8_gemm.ALIGN
    xp, padded, offs, dyp = s["xp"], s["padded"], s["offs"], g["dyp"]
    out = []

    def add(block: str, args: str, calls: int, fn: Callable[[], object], on_path: bool = True) -> None:
        out.append({"variant": "fp8", "block": block, "args": args, "calls": calls if on_path else 0,
                    "us": round(timer(fn), 2)} | ({} if on_path else {"on_path": False}))

    add("pad_groups", f"{_sig(x)} -> {_sig(xp)}", 1, lambda: ops.pad_groups(x, counts, align))
    add("unpad", f"{_sig(xp)} -> {_sig(x)}", 1, lambda: ops.unpad_groups(xp, padded))
    add("pad backward index_select", f"{_sig(xp)} -> {_sig(x)}", 1, lambda: xp.index_select(0, padded.index))
    add("unpad backward index_select", f"{_sig(x)} -> {_sig(xp)}", 1,
        lambda: F.pad(x, (0, 0, 0, 1)).index_select(0, padded.source))
    # grouped_mm_wgrad's pad: runs where the rows are no multiple of 16 (else timed as it would be)
    unaligned = [a for a in wgrads if a[0].shape[0] % align]
    rows = xp.shape[0] if xp.shape[0] % align else xp.shape[0] - align // 2
    xa, ya = xp[:rows], dyp[:rows]
    pad = align - rows % align
    add("wgrad row pad (F.pad x, dy)", f"{_sig(xa)}, {_sig(ya)} +{pad} rows", len(unaligned),
        lambda: (F.pad(xa, (0, 0, 0, pad)), F.pad(ya, (0, 0, 0, pad))), on_path=bool(unaligned))
    # the torch.where on empty groups' blocks (CUDA only) on each wgrad output shape
    for shape in sorted({(offs.shape[0], a[0].shape[1], a[1].shape[1]) for a in wgrads}):
        calls = sum((offs.shape[0], a[0].shape[1], a[1].shape[1]) == shape for a in wgrads)
        o = torch.empty(shape, device=xp.device, dtype=torch.bfloat16)

        def where(o=o):
            sizes = torch.diff(offs, prepend=offs.new_zeros(1))
            return torch.where((sizes > 0)[:, None, None], o, 0)
        add("wgrad torch.where", f"bf16[{','.join(map(str, shape))}]", calls, where, on_path=cuda)
    if not any(name == "_col_major" for name, *_ in log):  # CUDA: torchao writes column-major itself
        add("_col_major", _sig(w1), 0, lambda: fp8_gemm._col_major(w1), on_path=False)
    return out


def summary(res: dict) -> list[str]:
    """A few lines for the log: the phases, FP8 against bf16, the categories and the largest blocks."""
    sh, ph = res["shape"], res["phases_us"]
    lines = [f"FP8 profile on {res['device']} ({res['timer']}): one experts layer, {sh['rows']} rows over "
             f"{sh['groups']} experts, {sh['dim']} -> {sh['expert_dim']} -> {sh['dim']}"]
    for n in VARIANTS:
        t = ph[n]
        lines.append(f"  {n:5s} fwd {t['fwd']:.0f} + dgrad {t['dgrad']:.0f} + wgrad {t['wgrad']:.0f} = "
                     f"{t['total']:.0f} us (at once {t['layer_at_once']:.0f}); kernels busy "
                     + " / ".join(f"{res['busy_us'][n][p]:.0f}" for p in PHASES))
    lines.append("  fp8/bf16 " + ", ".join(f"{p} {r}x" for p, r in res["fp8_over_bf16"].items()))
    for n in VARIANTS:
        cats = {c: sum(res["categories"][n][p][c] for p in PHASES) for c in CATEGORIES}
        tot = sum(cats.values()) or 1.0
        lines.append(f"  {n:5s} by category: "
                     + ", ".join(f"{c} {us:.0f} us ({us / tot:.0%})" for c, us in cats.items()))
    fp8_total = ph["fp8"]["total"] or 1.0
    lines.append(f"  FP8 blocks alone (us x calls = us per layer, share of the FP8 layer's {fp8_total:.0f} us):")
    for b in [b for b in res["blocks"] if b["variant"] == "fp8"][:10]:
        lines.append(f"    {b['block']} {b['args']}: {b['us']:.1f} x {b['calls']} = {b['us_per_layer']:.0f} "
                     f"({b['us_per_layer'] / fp8_total:.0%})")
    g16 = sum(b["us_per_layer"] for b in res["blocks"] if b["variant"] == "bf16")
    g8 = sum(b["us_per_layer"] for b in res["blocks"] if b["block"] == "scaled_grouped_mm")
    lines.append(f"  GEMMs alone: FP8 scaled_grouped_mm {g8:.0f} us per layer, bf16 grouped_mm {g16:.0f}")
    lines.append(f"  SQNR FP8 vs bf16 (dB): {res['sqnr_db']}")
    return lines
