"""Markdown tables from a folder of benchmark outputs (the ``peer`` subcommand writes one).

    python -m fxoverlap.bench summary DIR

Reads every ``DIR/*.json`` that ``python -m fxoverlap.bench --out DIR --name <name>``
wrote (run ``<name>``, less a leading ``fx_``; the ``peer`` subcommand names them
``fx_<regime>_<routing>``, the ``one`` subcommand ``peer_<routing>`` and ``small_<routing>``)
and ``DIR/peer_<regime>_<routing>_overlap{0,1}.log`` (the ``RESULT {...}`` line of
``peer_megatron.py``), and prints:

* per run, eager against fxoverlap (T_serial, T_bound, overlap efficiency, memory);
* per run and mode (``eager``, ``compile`` = ``torch.compile(model)``, ``backend`` =
  ``torch.compile(model, backend="fxoverlap")``, ``fxoverlap``): step time, tokens/s,
  peak memory, the speed-ups against eager and against compile (the bench's
  ``speedups``), the first step's time and the gradients' difference from eager;
* the peer's figures, and ours and the peer's side by side.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys


def _f(v, spec=".1f"):
    return "-" if v is None else format(v, spec)


def load_ours(d: str) -> dict[str, dict]:
    out = {}
    for path in sorted(glob.glob(os.path.join(d, "*.json"))):
        with open(path) as fh:
            try:
                r = json.load(fh)
            except json.JSONDecodeError:
                continue
        if isinstance(r, dict) and "modes" in r:  # a bench result, not another JSON file
            name = os.path.basename(path)[:-5]
            out[name[3:] if name.startswith("fx_") else name] = r
    return out


def load_peer(d: str) -> dict[str, dict[int, dict]]:
    out: dict[str, dict[int, dict]] = {}
    for path in sorted(glob.glob(os.path.join(d, "peer_*_overlap[01].log"))):
        tag = os.path.basename(path)[5:-13]
        ov = int(path[-5])
        with open(path, errors="replace") as fh:
            for line in fh:
                if line.startswith("RESULT "):
                    out.setdefault(tag, {})[ov] = json.loads(line[7:])
    return out


def _table(columns: list[str], rows: list[list[str]]) -> list[str]:
    """A Markdown table."""
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns),
            *("| " + " | ".join(r) + " |" for r in rows)]


def _x(v) -> str:
    return "-" if v is None else f"{v:.3f}×"


def _pct(ratio) -> str:
    return "-" if ratio is None else f"{(ratio - 1) * 100:+.0f} %"


def ours_table(ours: dict[str, dict]) -> list[str]:
    rows = []
    for tag, r in ours.items():
        m = r.get("modes", {})
        e, f = m.get("eager", {}), m.get("fxoverlap", {})
        ratio = r.get("peak_mem_ratio_vs_eager")
        rows.append([
            tag, _f(e.get("step_ms")), _f(f.get("step_ms")), _x(r.get("speedup_vs_eager")),
            _f(r.get("T_serial_ms")), _f(r.get("T_bound_ms")), _f(r.get("overlap_efficiency"), ".2f"),
            f"{_f(e.get('tokens_per_s'), '.0f')} → {_f(f.get('tokens_per_s'), '.0f')}",
            f"{_f(e.get('peak_mem_gib'), '.2f')} → {_f(f.get('peak_mem_gib'), '.2f')}"
            + ("" if ratio is None else f" ({_pct(ratio)})"),
            _f(r.get("numerics", {}).get("loss_max_abs_diff"), ".2g"),
        ])
    return _table(["run", "eager ms", "fxoverlap ms", "speedup", "T_serial ms", "T_bound ms", "overlap eff.",
                   "tokens/s eager → fx", "peak GiB eager → fx", "loss max diff"], rows)


def _grad_diff(r: dict, mode: str) -> str:
    """Max abs gradient difference of ``mode`` from eager, relative to max |eager grad|
    (for eager itself: a second eager step on the same data, its run-to-run noise)."""
    n = r.get("numerics", {})
    if mode == "eager":
        diff, bitwise = n.get("eager_rerun_grad_max_abs_diff"), n.get("eager_rerun_grads_bitwise")
        scale = n.get("grad_max_abs_eager") or next(
            (v.get("grad_max_abs_eager") for v in n.values() if isinstance(v, dict)), None)
    else:
        g = n if mode == "fxoverlap" else n.get(mode, {})
        diff, bitwise, scale = g.get("grad_max_abs_diff"), g.get("grads_bitwise"), g.get("grad_max_abs_eager")
    if diff is None:
        return "-"
    return "bitwise" if bitwise else f"{diff / scale if scale else diff:.2g}"


def modes_table(ours: dict[str, dict]) -> list[str]:
    rows = []
    for tag, r in ours.items():
        sp = r.get("speedups", {})
        for mode, m in r.get("modes", {}).items():
            rows.append([
                tag, mode, _f(m.get("step_ms")), _f(m.get("tokens_per_s"), ".0f"), _f(m.get("peak_mem_gib"), ".2f"),
                _x(sp.get("eager", {}).get(mode)), _x(sp.get("compile", {}).get(mode)),
                _f(m.get("first_step_s"), ".1f"), _grad_diff(r, mode),
            ])
    return _table(["run", "mode", "step ms", "tokens/s", "peak GiB", "vs eager", "vs compile", "first step s",
                   "grad diff vs eager (rel.)"], rows)


def _peer_figures(by: dict[int, dict]) -> tuple[dict, dict, float | None, float | None, float | None, float | None]:
    """Overlap off and on: their results, step times and peak memory (largest rank)."""
    off, on = by.get(0, {}), by.get(1, {})
    a, b = off.get("step_ms_median_cuda_event"), on.get("step_ms_median_cuda_event")
    pa = max(off.get("max_memory_allocated_GiB_per_rank", [0]) or [0]) or None
    pb = max(on.get("max_memory_allocated_GiB_per_rank", [0]) or [0]) or None
    return off, on, a, b, pa, pb


def peer_table(peer: dict[str, dict[int, dict]]) -> list[str]:
    rows = []
    for tag, by in peer.items():
        off, on, a, b, pa, pb = _peer_figures(by)
        rows.append([
            tag, _f(a), _f(b), _x(a / b if a and b else None),
            f"{_f(off.get('tokens_per_s_global'), '.0f')} → {_f(on.get('tokens_per_s_global'), '.0f')}",
            f"{_f(pa, '.2f')} → {_f(pb, '.2f')}",
        ])
    return _table(["run", "overlap off ms", "overlap on ms", "speedup", "tokens/s off → on", "peak GiB off → on"], rows)


def side_by_side(ours: dict[str, dict], peer: dict[str, dict[int, dict]]) -> list[str]:
    rows = []
    for tag, by in peer.items():
        r = ours.get(tag, {})
        _, on, a, b, pa, pb = _peer_figures(by)
        rows.append([
            tag, _x(r.get("speedup_vs_eager")), _x(a / b if a and b else None),
            _f(r.get("modes", {}).get("fxoverlap", {}).get("tokens_per_s"), ".0f"),
            _f(on.get("tokens_per_s_global"), ".0f"),
            _pct(r.get("peak_mem_ratio_vs_eager")), _pct(pb / pa if pa and pb else None),
        ])
    return _table(["regime, routing", "speedup fxoverlap vs our eager", "speedup Megatron overlap on vs off",
                   "tokens/s fxoverlap", "tokens/s Megatron (on)", "peak mem. change fxoverlap",
                   "peak mem. change Megatron"], rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", help="a folder of bench JSON (and peer logs)")
    d = p.parse_args(argv).folder
    ours, peer = load_ours(d), load_peer(d)
    lines = ["## fxoverlap (python -m fxoverlap.bench)", "", *ours_table(ours), "",
             "## Every mode (speed-ups against eager and against torch.compile(model))", "",
             *modes_table(ours), ""]
    if peer:
        lines += ["## Megatron-Core peer (peer_megatron.py)", "", *peer_table(peer), "",
                  "## Side by side", "", *side_by_side(ours, peer), ""]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
