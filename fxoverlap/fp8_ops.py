"""FP8 rowwise experts: ``OverlapConfig(expert_dtype="fp8_rowwise")``.

Two custom ops, the FP8 versions of ``fxoverlap::grouped_mm`` and its weight gradient:

* ``fxoverlap::grouped_mm_fp8(x, w, offs)``: ``x[group g] @ w[g]`` with ``x`` quantized per row
  and ``w[g]`` per column (``kernels/fp8_gemm.py``). Its autograd gives the input gradient as
  the same op on ``(dy, w^T)`` and the weight gradient as the second op, so the backward's
  weight gradient stays a node of its own that ``delay_wgrad`` moves (``passes/split.py``),
  unlike torchao's fused autograd Function.
* ``fxoverlap::grouped_mm_fp8_wgrad(x, dy, offs)``: ``x[group g]^T @ dy[group g]``, both
  quantized per column within each group.

Parameters stay plain tensors (quantized at each call, as torchtitan does); both ops have fake
kernels, so the experts stages stay Inductor-compiled around them.

The model code does not change: ``fxoverlap.ops.grouped_mm`` runs the FP8 op while
:func:`expert_math` is active, and ``ops.expert_rows`` pads each expert's row group to
:data:`ROW_ALIGN` rows there (the CUDA kernel's alignment). ``fxoverlap.optimize`` traces the model
under ``expert_math(config.expert_dtype)`` after :func:`check_expert_dtype` accepted the device;
eager PyTorch with the same FP8 math is ``with expert_math("fp8_rowwise"): model(...)``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
from collections.abc import Iterator

import torch

from fxoverlap.config import EXPERT_DTYPES, ConfigError
from fxoverlap.ir.errors import FxOverlapError
from fxoverlap.kernels import fp8_gemm, grouped_gemm

ROW_ALIGN = fp8_gemm.ALIGN  # rows per expert group start, and K and N, in FP8
MIN_CAPABILITY = (8, 9)  # torch._scaled_grouped_mm's FP8 kernels: Ada (SM89), Hopper (SM90) and newer
TORCHAO = "0.18.0"  # the pinned release (setup.cfg's fp8 extra)
_TORCHAO_KERNELS = ("triton_fp8_rowwise_2d_scale_and_cast", "triton_fp8_colwise_3d_scale_and_cast",
                    "triton_fp8_per_group_colwise_scales_dual")
INSTALL = (f"pip install 'fxoverlap[fp8]' (torchao=={TORCHAO}; where the machine reaches no registry, "
           f"`pip download --no-deps torchao=={TORCHAO}` elsewhere and install that wheel with --no-deps)")


class Fp8Unavailable(ConfigError):
    """``OverlapConfig(expert_dtype="fp8_rowwise")`` cannot run here: the model is not on a CUDA GPU,
    the GPU is below compute capability 8.9, torch has no ``_scaled_grouped_mm``, or torchao is
    missing. The message names each condition and the fix. A ConfigError (so a ValueError)."""


class Fp8ExpertError(FxOverlapError, ValueError):
    """An expert GEMM the FP8 grouped GEMM cannot take: its K or N (the model's hidden size and
    expert intermediate size) not a multiple of 16, or a dtype other than bfloat16 / float32.
    The message names the sizes and the fix."""


# ---------------------------------------------------------------- availability


def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def _find_torchao():
    return importlib.util.find_spec("torchao")


def _torchao_problem() -> str | None:
    """Why torchao's FP8 kernels cannot be used (None: they import)."""
    if _find_torchao() is None:
        return f"torchao is not installed: {INSTALL}"
    try:
        import torchao
        from torchao.prototype.moe_training import kernels
    except Exception as e:  # noqa: BLE001  (a build whose CUDA extensions fail to load raises anything)
        return f"`import torchao.prototype.moe_training.kernels` failed ({type(e).__name__}: {e}); {INSTALL}"
    if missing := [k for k in _TORCHAO_KERNELS if not hasattr(kernels, k)]:
        return (f"torchao {getattr(torchao, '__version__', '?')} has no {', '.join(missing)} (fxoverlap uses "
                f"torchao=={TORCHAO}'s rowwise quantization kernels): {INSTALL}")
    return None


def fp8_unavailable(device: torch.device) -> list[str]:
    """Every reason FP8 rowwise experts cannot run on ``device`` (empty: they can). torchao is
    imported only where the device itself qualifies."""
    why = []
    if not hasattr(torch, "_scaled_grouped_mm"):
        why.append(f"torch {torch.__version__} has no torch._scaled_grouped_mm (torch >= 2.11 has it)")
    device_why = None
    if device.type != "cuda":
        device_why = (f"the model's parameters are on {device.type}: the FP8 grouped GEMM "
                      f"(torch._scaled_grouped_mm) runs on CUDA GPUs of compute capability "
                      f">= {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} (Ada, Hopper and newer)")
    elif (cap := tuple(_capability(device))) < MIN_CAPABILITY:
        device_why = (f"{device} is compute capability {cap[0]}.{cap[1]}, below "
                      f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}: it has no FP8 tensor cores for "
                      f"torch._scaled_grouped_mm (Ada SM89, Hopper SM90 and newer do)")
    if device_why is not None:  # torchao's kernels are not imported here: only whether it is installed
        why.append(device_why)
        if _find_torchao() is None:
            why.append(f"torchao is not installed: {INSTALL}")
        return why
    if (problem := _torchao_problem()) is not None:
        why.append(problem)
    return why


def check_expert_dtype(expert_dtype: str | None, device: torch.device) -> None:
    """Raise :class:`Fp8Unavailable` when ``expert_dtype`` cannot run on ``device`` (None: nothing to check)."""
    if expert_dtype is None:
        return
    if expert_dtype not in EXPERT_DTYPES:
        raise ConfigError(f"OverlapConfig.expert_dtype must be one of {EXPERT_DTYPES} or None, got {expert_dtype!r}")
    if why := fp8_unavailable(device):
        raise Fp8Unavailable(
            f"OverlapConfig(expert_dtype={expert_dtype!r}) cannot run here: {'; '.join(why)}. Leave expert_dtype=None "
            f"(the experts in the model's dtype)")


# ---------------------------------------------------------------- the active expert math


@dataclasses.dataclass(frozen=True)
class ExpertMath:
    """What ``ops.grouped_mm`` and ``ops.expert_rows`` do while tracing or running the model:
    the experts' GEMM dtype (None: the model's) and the row alignment of each expert's group."""

    dtype: str | None = None
    row_align: int = 1


# A module global, not a ContextVar: Dynamo reads a global (and guards on it) when torch.compile
# traces a model under expert_math (the bench's compile baseline).
_current = ExpertMath()


def current() -> ExpertMath:
    """The expert math in effect (default: the model's dtype, no padding)."""
    return _current


@contextlib.contextmanager
def expert_math(dtype: str | None = None, row_align: int | None = None) -> Iterator[ExpertMath]:
    """Run (or trace) the experts with ``dtype`` (``"fp8_rowwise"`` or None) and each expert's row
    group padded to ``row_align`` rows (default: 16 under FP8, else 1). No device check: the
    front ends call :func:`check_expert_dtype` first."""
    if dtype is not None and dtype not in EXPERT_DTYPES:
        raise ConfigError(f"expert_math: dtype must be one of {EXPERT_DTYPES} or None, got {dtype!r}")
    align = row_align if row_align is not None else (ROW_ALIGN if dtype is not None else 1)
    if isinstance(align, bool) or not isinstance(align, int) or align < 1:
        raise ConfigError(f"expert_math: row_align must be an int >= 1, got {row_align!r}")
    if dtype is not None and align % ROW_ALIGN:
        raise ConfigError(f"expert_math: FP8 experts need row_align a multiple of {ROW_ALIGN}, got {align}")
    global _current
    saved, _current = _current, ExpertMath(dtype, align)
    try:
        yield _current
    finally:
        _current = saved


# ---------------------------------------------------------------- the ops


@torch.library.custom_op("fxoverlap::grouped_mm_fp8", mutates_args=())
def _grouped_mm_fp8(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return fp8_gemm.grouped_mm(x, w, offs).to(x.dtype)


@_grouped_mm_fp8.register_fake
def _(x, w, offs):
    return x.new_empty(x.shape[0], w.shape[-1])


@torch.library.custom_op("fxoverlap::grouped_mm_fp8_wgrad", mutates_args=())
def _grouped_mm_fp8_wgrad(x: torch.Tensor, dy: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return fp8_gemm.grouped_mm_wgrad(x, dy, offs).to(x.dtype)


@_grouped_mm_fp8_wgrad.register_fake
def _(x, dy, offs):
    return x.new_empty(offs.shape[0], x.shape[1], dy.shape[1])


# the input gradient is the forward op on (dy, w^T): dy quantized per row, w^T per column (over N)
grouped_gemm.register_split_backward(_grouped_mm_fp8, _grouped_mm_fp8_wgrad)


def check_gemm(x: torch.Tensor, w: torch.Tensor) -> None:
    """Raise :class:`Fp8ExpertError` where the FP8 grouped GEMM cannot take ``x[M, K] @ w[G, K, N]``."""
    k, n = w.shape[-2], w.shape[-1]
    if x.dtype not in (torch.bfloat16, torch.float32) or w.dtype != x.dtype:
        raise Fp8ExpertError(
            f"fxoverlap expert_dtype='fp8_rowwise': an expert GEMM takes rows of {x.dtype} and weights of {w.dtype}; "
            f"the FP8 grouped GEMM quantizes bfloat16 or float32 (one dtype for both). Train the model in bfloat16, "
            f"or leave OverlapConfig(expert_dtype=None)")
    bad = [f"{name}={v}" for name, v in (("K", k), ("N", n)) if v % ROW_ALIGN]
    if bad:
        raise Fp8ExpertError(
            f"fxoverlap expert_dtype='fp8_rowwise': an expert GEMM multiplies rows [M, K={k}] by weights "
            f"[{w.shape[0]} experts, K={k}, N={n}], and torch._scaled_grouped_mm needs K and N multiples of "
            f"{ROW_ALIGN} (16-byte FP8 rows); {', '.join(bad)} is not. K and N are the model's expert sizes "
            f"(its hidden size and the experts' intermediate size, 2x that for a fused gate/up weight): "
            f"use sizes that are multiples of {ROW_ALIGN}, or leave OverlapConfig(expert_dtype=None)")


def grouped_mm_fp8(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``x[rows of group g] @ w[g]`` in FP8 rowwise (``offs``: int32 group ends, each group starting
    at a multiple of 16 rows on CUDA); ``x.dtype`` out."""
    check_gemm(x, w)
    return _grouped_mm_fp8(x, w, offs)


GROUPED_MM_FP8_OP = torch.ops.fxoverlap.grouped_mm_fp8.default
GROUPED_MM_FP8_WGRAD_OP = torch.ops.fxoverlap.grouped_mm_fp8_wgrad.default


def check_fp8_applied(expert_dtype: str | None, gm: torch.fx.GraphModule, model: str) -> None:
    """Raise :class:`Fp8ExpertError` when ``expert_dtype`` is set but the traced graph has no FP8
    expert GEMM: the model's experts do not run through ``fxoverlap.ops.grouped_mm`` (torchtitan's
    own grouped GEMM, a dense model), so the option would silently change nothing."""
    if expert_dtype is None or any(n.target is GROUPED_MM_FP8_OP for n in gm.graph.nodes):
        return
    raise Fp8ExpertError(
        f"OverlapConfig(expert_dtype={expert_dtype!r}): {model}'s traced step has no expert GEMM of fxoverlap's "
        f"(fxoverlap.ops.grouped_mm), so nothing would run in FP8. It applies to the reference model "
        f"(fxoverlap.models), to transformers models after fxoverlap.expert_parallel(model, ep_group), and to "
        f"torchtitan models whose experts are a GroupedExperts (their _grouped_mm seam). Leave expert_dtype=None")
