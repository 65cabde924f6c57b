"""OverlapConfig: every knob of fxoverlap in one frozen dataclass."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib
from collections.abc import Iterable, Mapping
from typing import Any, Literal

from fxoverlap.ir.errors import FxOverlapError

COMPILERS = ("inductor", "eager")
# Recognised, not built: the model calls torchtitan's deepep::/hybridep:: ops itself.
DEEPEP_DISPATCHERS = ("deepep", "hybridep")
# The one list of dispatcher names (passes/dispatcher.py takes it from here).
DISPATCHERS = ("auto", "all_to_all", "padded", "symm_mem", *DEEPEP_DISPATCHERS)
GRAD_REDUCE_MODES = ("all_reduce", "reduce_scatter")
# OverlapConfig.expert_dtype's values (fxoverlap/fp8_ops.py runs them)
EXPERT_DTYPES = ("fp8_rowwise",)
# OverlapConfig(chunks=None) on CUDA (docs/benchmarks.md, "Chunks", has the measurement behind it).
DEFAULT_CUDA_CHUNKS = 2
# ... and where a program runs one microbatch per call (the torch.compile backend, pipeline stages),
# only the layers whose forward dispatch sends at least this many bytes a microbatch. Measured with
# the backend, emulated EP 8 at 100 GB/s: at the peer's shape (256 MiB a dispatch) chunks 2 made the
# step 1.19x torch.compile's against 1.05x with chunks 1 (H100); at the Qwen3-30B-A3B (64 MiB) and
# DeepSeek-V3 MLA (48 MiB) layer shapes chunks 1 was the faster: 1.007 / 0.974x against 0.965 / 0.967x
# (H200), 1.005x against 0.85x (Qwen3, H100). The bound sits between (docs/benchmarks.md,
# thirteenth, sixteenth and nineteenth sessions). Measured in training; the backend's forward-only
# calls follow the same rule unmeasured.
DEFAULT_CUDA_ONE_MICROBATCH_MIN_CHUNK_EXCHANGE_BYTES = 128 * 2**20
# OverlapConfig(delay_wgrad=None) on CUDA: measured 2-4 % faster steps with the weight gradients
# split off (expert_wgrad_slot=2), docs/benchmarks.md "where the merged steps lose time".
DEFAULT_CUDA_DELAY_WGRAD = True
# OverlapConfig(sm_carveout=None) on CUDA: SMs the experts' GEMMs leave to the comm kernels. Measured
# (one H200, emulated EP 8 at 100 GB/s, 16-block comm kernels; docs/benchmarks.md, 2026-12-02 eighth
# session): 24 on the experts stages took 6.5 % off optimize's step (on every stage: 16 2.5 %, 24
# 4.7 %, 32 2.4 %); where the exchanges are short it costs: 2.3 % at EP 2 over NVLink, 1.2 % at 300 GB/s.
DEFAULT_CUDA_SM_CARVEOUT = 24


class ConfigError(FxOverlapError, ValueError):
    """A setting fxoverlap cannot take: an ``OverlapConfig`` field out of range, an option the
    ``"fxoverlap"`` backend does not know or cannot honour; the message names it and the fix."""


class UnknownConfigField(ConfigError, TypeError):
    """A setting name fxoverlap does not know: an ``OverlapConfig`` keyword that is no field of it,
    an option of the ``"fxoverlap"`` backend that is neither a field nor an Inductor option. The
    message names it and its closest known names. A TypeError, as Python's own "unexpected keyword
    argument" is, and a ConfigError (so a ValueError)."""


def unknown_names(names: Iterable[object], known: Iterable[str]) -> str:
    """``names`` as ``'chunk' (did you mean 'chunks'?), 'x'``: each with its closest ``known`` names."""
    known = sorted(set(known))
    parts = []
    for name in names:
        close = difflib.get_close_matches(str(name), known, n=3)
        parts.append(f"{name!r}" + (f" (did you mean {', '.join(map(repr, close))}?)" if close else ""))
    return ", ".join(parts)


class DispatcherUnavailable(ConfigError, ImportError):
    """``OverlapConfig(dispatcher="deepep" | "hybridep")`` without the package it needs; the
    message says how to get it. A ValueError, as every bad ``dispatcher`` is, and an ImportError."""


def deepep_missing(dispatcher: str) -> str | None:
    """Why ``dispatcher`` ("deepep" / "hybridep") cannot run here, or None when ``deep_ep``
    (with ``HybridEPBuffer`` for "hybridep") imports."""
    try:
        deep_ep = importlib.import_module("deep_ep")
    except Exception as e:  # noqa: BLE001  (a build without its CUDA libraries raises OSError)
        return f"`import deep_ep` failed ({type(e).__name__}: {e})"
    if dispatcher == "hybridep" and not hasattr(deep_ep, "HybridEPBuffer"):
        return "the installed deep_ep has no HybridEPBuffer (it is not a hybrid-ep build)"
    return None


def _deepep_error(dispatcher: str, why: str) -> DispatcherUnavailable:
    return DispatcherUnavailable(
        f"OverlapConfig(dispatcher={dispatcher!r}) needs DeepEP: {why}. Get it from "
        f"https://github.com/deepseek-ai/DeepEP: V1's intranode buffer is deep_ep/buffers/legacy.py, HybridEP is "
        f"the `hybrid-ep` branch; torchtitan's DeepEP module (torchtitan/distributed/deepep/deepep.py) needs "
        f"DeepEP V2 (deep_ep.ElasticBuffer), which needs NCCL >= 2.30.4. fxoverlap does not yet lower its own "
        f"dispatch/combine ops to DeepEP: with this dispatcher the model must call torchtitan's "
        f"{'deepep::' if dispatcher == 'deepep' else 'hybridep::'} ops itself (torchtitan's "
        f"{'DeepEP' if dispatcher == 'deepep' else 'HybridEP'}TokenDispatcher), which fxoverlap's tag pass "
        f"recognises under any dispatcher setting. Otherwise use dispatcher='auto', 'all_to_all', 'padded' or "
        f"'symm_mem'"
    )


# The front ends that take an OverlapConfig (a field's metadata says which refuse it).
OPTIMIZE, BACKEND, PIPELINE = "optimize", "backend", "pipeline"
# What a field changes: "capture" (the trace), "stages" (the split and the stage compiles),
# "program" (the schedule, once per microbatch count), "runtime" (how a run runs), "front end".
PHASES = ("capture", "stages", "program", "runtime", "front end")


def _field(default: Any, phase: str, *, refused_by: Mapping[str, str] | None = None, **kwargs: Any) -> Any:
    """A config field with its metadata: the phase it affects and the front ends that cannot honour
    a value other than its default, each with the reason (:func:`refused_fields` reads them)."""
    return dataclasses.field(default=default, metadata={"phase": phase, "refused_by": dict(refused_by or {})},
                             **kwargs)


@dataclasses.dataclass(frozen=True)
class OverlapConfig:
    """Settings for :func:`fxoverlap.optimize` and the ``"fxoverlap"`` torch.compile backend.

    Attributes:
        compiler: how compute stages run. ``"inductor"``: each is lowered by
            TorchInductor once per plan (fused kernels, as ``torch.compile`` gives);
            ``"eager"``: op by op, exactly the aten ops eager PyTorch runs (bitwise
            equal to eager on CPU). ``None``: ``"inductor"`` when the model's
            parameters are on CUDA, ``"eager"`` otherwise.
        compile_options: Inductor config patches for the compiled stages, as
            ``torch.compile(options=...)`` takes them (e.g. ``{"max_autotune": True}``).
        layer_container: attribute path of the model's list of decoder layers
            (e.g. ``"layers"``). ``None``: the outermost ``nn.ModuleList`` /
            ``nn.ModuleDict`` whose entries hold every all-to-all (``passes/layers.py``;
            with none, the outermost with the most entries), for both entry points.
        side_stages: split each MoE layer's attn work into what its dispatch needs
            and the rest (shared expert, routing weights), which runs under the
            dispatch; likewise in the backward under the combine (``passes/side.py``).
        comm_stream_priority: CUDA priority of the communication stream; lower
            numbers are higher priority (-1 is high on current GPUs). NCCL runs its
            own kernels on an internal stream: give that one priority with
            ``ProcessGroupNCCL.Options(is_high_priority_stream=True)`` when creating
            the EP group (``python -m fxoverlap.bench`` does; see docs/benchmarks.md).
        sm_carveout: SMs the experts' grouped GEMMs leave free (torch's
            ``torch._C._set_sm_carveout_experimental``, which ``torch._grouped_mm``, cuBLAS and
            Inductor's persistent templates read), so a comm kernel beside them finds SMs free
            and their last blocks are not pushed into a second wave (measured 1.6-1.7x slower
            beside the emulated comm kernel without it, 1.01-1.04x with 24; cuBLAS GEMMs and
            SDPA gain nothing from it, so they keep every SM). Set around each experts stage call
            of a run whose exchanges run comm kernels (more than one EP rank, or the emulated
            link), and restored after it. ``None`` (default): :data:`DEFAULT_CUDA_SM_CARVEOUT` on
            CUDA (measured with the emulated link's 16-block comm kernel: a real NCCL or
            DeepEP kernel may take another number of SMs; tune it to yours), torch's
            setting left as it is elsewhere; ``0``: GEMMs use every SM.
        delay_wgrad: split each backward attn/experts/MLP stage into its input-gradient
            and weight-gradient parts and run the weight-gradient part where it fills an
            exchange's time (``passes/schedule.py``). ``None`` (default):
            :data:`DEFAULT_CUDA_DELAY_WGRAD` on CUDA, off on CPU (where nothing overlaps).
        free_early: insert early-free nodes so each value is dropped at its last use.
        cuda_graphs: run capturable compute stages as CUDA graphs (GPU only).
            ``None`` (default): on CUDA, unless a graph would copy in a value over
            64 MiB from an eager stage at every replay (``passes/cudagraph.py``: at
            the measured shapes graphs then cost more than they save); off on CPU.
            ``True``: always (a warning and no-op on CPU); ``False``: never. Graphs
            share one memory pool per microbatch parity that follows the program's
            liveness, so they need no more memory than eager stages
            (``fxoverlap/cudagraphs.py``). Call ``engine.close()`` before destroying
            the process group.
        mhc_recompute_group: with mHC layers, replay the hyper-connection forward
            of each group of this many layers before the group's backward instead
            of saving its activations. ``None``: recompute off.
        ac_replay_comm: with activation checkpointing, replay the all-to-alls of the
            checkpointed regions in the backward, as eager's checkpoint does, instead of
            keeping their outputs from forward to backward (``passes/recompute.py``).
            Saves each MoE layer's dispatch and combine outputs per microbatch in flight;
            costs those exchanges again, on the comm stream. Default off: what fxoverlap
            hides is the exchange time (measured on one H200 at the peer's shape: peak
            1.06x eager-with-AC's with the replay, 1.21x without; docs/benchmarks.md).
        record_memory: keep a per-step trace of live values and bytes
            (``engine.memory_trace``); for tests and debugging.
        progress: print a line per compiled stage and the compile time (rank 0).
        dispatcher: how fxoverlap's dispatch/combine ops run (``passes/dispatcher.py``):
            ``"all_to_all"`` (variable split sizes, one host read per dispatch),
            ``"padded"`` (fixed per-link capacity, equal-split all-to-all, no host
            read; any device), ``"symm_mem"`` (the same layout, real rows written into
            the peers' symmetric memory; CUDA, one host), or ``"auto"``: ``symm_mem``
            where it can run with more than one EP rank, else ``all_to_all``.
            ``"deepep"`` / ``"hybridep"``: recognised, not built: the model calls
            torchtitan's ``deepep::`` / ``hybridep::`` ops itself (its DeepEP / HybridEP
            token dispatcher) and fxoverlap leaves them as they are; fxoverlap's own
            dispatch/combine ops are refused. Needs ``deep_ep`` (a ``hybrid-ep`` build for
            ``"hybridep"``); without it the config raises ``DispatcherUnavailable``.
        dispatch_capacity_factor: static dispatchers only. ``None``: each link can
            carry every row a rank could send it (never overflows). A factor ``f``:
            ``f`` times the balanced share (``rows sent / ep``), saving memory; a step
            that needs more raises ``DispatchOverflow`` with ``p.grad`` as before it.
        grad_reduce: with ``optimize(..., dp_group=...)``, how the program reduces
            gradients over the data-parallel groups (``docs/data_parallel.md``):
            ``"all_reduce"``: every rank's ``p.grad`` is the averaged gradient;
            ``"reduce_scatter"``: each rank keeps only its shard of it (ZeRO-2),
            handed to the optimizer by ``engine.shard_parameters()``.
        shard_params: with ``optimize(..., dp_group=...)``, fully shard the parameters
            (ZeRO-3, ``docs/data_parallel.md``): at the first ``plan`` / step each parameter
            becomes a ``Shard(0)`` DTensor over its group (dense: ``dp_group``; expert:
            ``expert_dp_group``), the program gathers each layer's units just ahead of their
            first reader on a stream and communicator of their own and drops them after the
            last, and the gradients are reduce-scattered into the DTensors' ``.grad`` (whatever
            ``grad_reduce`` says). Build the optimizer on ``model.parameters()`` after the first
            ``plan`` / step (one built before it, and not stepped yet, is updated in place).
            No CUDA graphs (a gathered parameter's memory changes every step).
        keep_gathered_mb: with ``shard_params``, how many MiB of gathered parameters the
            program may hold at once so as to keep a unit gathered between two of its uses
            instead of dropping and gathering it again (FSDP2's ``reshard_after_forward=False``,
            bounded): ``0`` (the default) drops each unit after every use (the least memory:
            at most the units in use and one gather ahead, ``engine.plan`` prints how many);
            ``float("inf")`` gathers each unit once per step. In between, the shortest gaps are
            kept first while the gathered parameters stay within the budget. Each kept gap
            saves one all-gather of the unit's bytes over ``dp_group``.
        unshard_ahead: with ``shard_params``, how many uses ahead of its first reader a
            unit's all-gather is issued: ``1`` (the default) under the use just before it,
            ``2`` one use earlier still (more time for the gather to finish where the DP link
            is queued or slow; one more unit gathered at a time).
        reduce_bucket_mb: gradients are reduced in flat buckets of at least this
            many MiB (25, as DDP's ``bucket_cap_mb``), each issued as soon as its
            gradients are final; ``0``: one bucket per backward stage and group.
        chunks: cut each MoE layer's dispatch -> experts -> combine into this many chunks
            along its local experts (``passes/chunk.py``), so one chunk's all-to-all runs
            under another chunk's experts: this is what hides the exchanges where no other
            microbatch is there to pair with (the ``torch.compile`` backend's one
            microbatch per call, F(0) and B(N-1) of the 1F1B program, forward-only calls).
            Everything that reduces over the microbatch's tokens (router, its statistics and
            losses, the loss) still runs once on all of them, and each expert's rows stay in
            one chunk, so the weight gradients are eager's sums. ``1``: off. ``None``:
            :data:`DEFAULT_CUDA_CHUNKS` on CUDA, 1 on CPU (where nothing overlaps; the CPU
            results stay bitwise eager's); where a program runs one microbatch per call (the
            backend, pipeline stages) the default cuts only layers whose dispatch sends at least
            :data:`DEFAULT_CUDA_ONE_MICROBATCH_MIN_CHUNK_EXCHANGE_BYTES` (smaller exchanges
            measured faster unchunked). Cut: fxoverlap's ``dispatch``/``combine``, and
            torch's functional ``all_to_all_single`` with host split sizes, as torchtitan's
            ``AllToAllTokenDispatcher`` traces (``passes/chunk_functional.py``). A layer whose
            exchange is neither (token-once, the static dispatchers, DeepEP), or whose experts
            draw random numbers, runs unchunked, and the compile log says why.
        chunks_in_merged_steps: also run the chunks in the merged steps F(i+1) ⊗ B(i) of
            ``optimize``'s 1F1B program, where the other microbatch already hides the
            exchanges and chunks only add their cost (smaller GEMMs, the rows' copies).
            ``False`` (the default): a layer cut into chunks keeps its whole exchange too,
            and the program runs the chunks for microbatches 0 and N-1 (F(0) and B(0),
            F(N-1) and B(N-1)) and the whole exchange for the others; likewise the
            microbatch pairs of ``engine.forward_only`` run whole exchanges, and a last odd
            microbatch the chunks.
        expert_wgrad_slot: with ``delay_wgrad``, the merged-step slot in which B experts'
            weight-gradient part runs (``passes/schedule.py``): ``2`` (default) under the F
            dispatch, right after B experts' input-gradient part, so the compute stream fills
            its wait for the F dispatch with it instead of delaying B attn behind it; ``3``
            under the B dispatch, after F experts. Measured (one H200, emulated EP 8 at 100
            GB/s, the peer's shape, docs/benchmarks.md "where the merged steps lose time"):
            slot 2 takes 2-3 % off the step at 8 and 16 microbatches. No effect without
            ``delay_wgrad``.
        max_programs: how many compiled programs the engine keeps (least recently used
            evicted, its CUDA graphs released). A program is compiled per
            :class:`~fxoverlap.program_key.ProgramKey`: input shapes, the model's training
            flags, ``requires_grad``, autocast, hooks, the loss function, ...
            (docs/training_loop.md). 8, as Dynamo's ``recompile_limit``.
        autotune: choose ``chunks``, ``chunks_in_merged_steps``, ``delay_wgrad``,
            ``expert_wgrad_slot``, ``dispatcher``, ``sm_carveout`` and ``comm_stream_priority`` by
            measurement (:func:`fxoverlap.tune`, docs/tune.md) at the engine's first
            ``forward_backward`` (or ``forward_only``) call, on those microbatches, then run with the
            choice (cached on disk: later processes reuse it without timing). Tuning times steps
            with CUDA events: on a model whose parameters are not on CUDA the engine keeps the
            settings as given, with one ``TuneSkipped`` warning. Only ``fxoverlap.optimize``
            tunes; the other front ends refuse it (call ``fxoverlap.tune`` and pass its config).
        disable_passes: names of passes to switch off, for debugging (``fxoverlap.passes.PASSES``
            lists them in order, with why each can or cannot be). Switchable: ``"side"`` (as
            ``side_stages=False``), ``"cudagraph"`` (no CUDA graphs), ``"inductor"`` (compute
            stages op by op, as ``compiler="eager"``), ``"free"`` (values live to the end of the
            step, as ``free_early=False``): each leaves a correct program. The others
            (dispatcher, tag, rng, recompute, split, schedule, reduce, shard, streams) make or guard
            the program; naming one, or an unknown name, raises ValueError listing the valid ones.
        expert_dtype: the dtype of the experts' grouped GEMMs. ``None`` (default): the model's.
            ``"fp8_rowwise"``: float8_e4m3fn with rowwise scales (torchao's recipe: each GEMM's
            operands quantized along its contraction dim, power-of-two scales), through
            ``torch._scaled_grouped_mm`` and torchao's quantization kernels (``fxoverlap/fp8_ops.py``);
            parameters stay plain bf16/fp32 tensors, the weight gradient stays its own node (so
            ``delay_wgrad`` still moves it), and each expert's row group is padded to 16 rows
            without a host read. Needs a CUDA GPU of compute capability >= 8.9 and torchao
            (``pip install 'fxoverlap[fp8]'``); elsewhere ``fxoverlap.optimize`` raises
            ``Fp8Unavailable`` before tracing. The experts' K and N (hidden and intermediate sizes)
            must be multiples of 16 (``Fp8ExpertError``). Applies to the experts that run through
            ``fxoverlap.ops.grouped_mm`` (the reference model, ``fxoverlap.expert_parallel``).
    """

    compiler: Literal["inductor", "eager"] | None = _field(None, "stages")
    compile_options: Mapping[str, Any] | None = _field(None, "stages", hash=False)
    layer_container: str | None = _field(None, "capture")
    side_stages: bool = _field(True, "stages")
    comm_stream_priority: int = _field(-1, "runtime")
    sm_carveout: int | None = _field(None, "runtime")
    delay_wgrad: bool | None = _field(None, "stages")
    free_early: bool = _field(True, "program")
    cuda_graphs: bool | None = _field(None, "stages")
    mhc_recompute_group: int | None = _field(None, "stages")
    ac_replay_comm: bool = _field(False, "stages")
    record_memory: bool = _field(False, "runtime", refused_by={
        BACKEND: "the memory trace is engine.memory_trace, which only fxoverlap.optimize keeps",
        PIPELINE: "the memory trace is engine.memory_trace, which only fxoverlap.optimize keeps"})
    progress: bool = _field(True, "stages")
    dispatcher: Literal["auto", "all_to_all", "padded", "symm_mem", "deepep", "hybridep"] = _field("auto", "capture")
    dispatch_capacity_factor: float | None = _field(None, "stages", refused_by=dict.fromkeys(
        (BACKEND, PIPELINE), "it needs a check of the overflow flags after each step, which fxoverlap.optimize "
                             "makes and the other front ends do not"))
    grad_reduce: Literal["all_reduce", "reduce_scatter"] = _field("all_reduce", "program", refused_by={
        BACKEND: "the backend reduces no gradients over data parallelism (optimize(..., dp_group=...) does)",
        PIPELINE: "without dp_group there are no gradients to reduce (pipeline_schedule(..., dp_group=...) "
                  "reduces them)"})
    reduce_bucket_mb: float = _field(25.0, "program", refused_by={
        BACKEND: "the backend reduces no gradients over data parallelism (optimize(..., dp_group=...) does)",
        PIPELINE: "without dp_group there are no gradients to reduce (pipeline_schedule(..., dp_group=...) "
                  "reduces them)"})
    shard_params: bool = _field(False, "capture", refused_by={
        BACKEND: "the backend reduces no gradients over data parallelism (optimize(..., dp_group=..., "
                 "config=OverlapConfig(shard_params=True)) shards the parameters)",
        PIPELINE: "pipeline_schedule does not shard parameters yet; use grad_reduce='reduce_scatter' (ZeRO-2) there"})
    keep_gathered_mb: float = _field(0.0, "program", refused_by={
        BACKEND: "the backend does not shard parameters (optimize(..., dp_group=..., "
                 "config=OverlapConfig(shard_params=True)) does)",
        PIPELINE: "pipeline_schedule does not shard parameters yet"})
    unshard_ahead: int = _field(1, "program", refused_by={
        BACKEND: "the backend does not shard parameters (optimize(..., dp_group=..., "
                 "config=OverlapConfig(shard_params=True)) does)",
        PIPELINE: "pipeline_schedule does not shard parameters yet"})
    chunks: int | None = _field(None, "stages")
    chunks_in_merged_steps: bool = _field(False, "program", refused_by=dict.fromkeys(
        (BACKEND, PIPELINE), "its programs run one microbatch at a time, so they have no merged steps (their "
                             "layers run the chunks anyway)"))
    disable_passes: tuple[str, ...] = _field((), "stages")
    expert_wgrad_slot: int = _field(2, "program", refused_by=dict.fromkeys(
        (BACKEND, PIPELINE), "its programs run one microbatch at a time, so they have no merged steps"))
    autotune: bool = _field(False, "front end", refused_by=dict.fromkeys(
        (BACKEND, PIPELINE), "tuning times whole steps of fxoverlap.optimize's engine; call fxoverlap.tune(model, "
                             "ep_group, microbatches) and pass the OverlapConfig it returns"))
    expert_dtype: Literal["fp8_rowwise"] | None = _field(None, "capture", refused_by=dict.fromkeys(
        (BACKEND, PIPELINE), "it traces the model's expert GEMMs itself before this option could choose them; "
                             "use fxoverlap.optimize, or trace under fxoverlap.fp8_ops.expert_math('fp8_rowwise')"))
    max_programs: int = _field(8, "front end", refused_by={
        BACKEND: "Dynamo caches the backend's compiled graphs (torch._dynamo.config.recompile_limit bounds them)",
        PIPELINE: "each pipeline stage keeps the programs of its own schedule"})

    def __post_init__(self) -> None:
        if self.chunks is not None and (isinstance(self.chunks, bool) or not isinstance(self.chunks, int)
                                        or self.chunks < 1):
            raise ConfigError(f"OverlapConfig.chunks must be an int >= 1 (1: off) or None (chosen per device), "
                              f"got {self.chunks!r}")
        if self.sm_carveout is not None and (isinstance(self.sm_carveout, bool) or not isinstance(self.sm_carveout, int)
                                             or self.sm_carveout < 0):
            raise ConfigError(f"OverlapConfig.sm_carveout must be a number of SMs >= 0 or None (leave torch's "
                              f"setting), got {self.sm_carveout!r}")
        if self.expert_wgrad_slot not in (2, 3) or isinstance(self.expert_wgrad_slot, bool):
            raise ConfigError(f"OverlapConfig.expert_wgrad_slot must be 2 (under the F dispatch) or 3 (under the "
                              f"B dispatch), got {self.expert_wgrad_slot!r}")
        if self.dispatcher not in DISPATCHERS:
            raise ConfigError(f"OverlapConfig.dispatcher must be one of {DISPATCHERS}, got {self.dispatcher!r}")
        if self.dispatcher in DEEPEP_DISPATCHERS and (why := deepep_missing(self.dispatcher)) is not None:
            raise _deepep_error(self.dispatcher, why)
        if self.dispatch_capacity_factor is not None and not self.dispatch_capacity_factor > 0:
            raise ConfigError(
                f"OverlapConfig.dispatch_capacity_factor must be > 0 (a multiple of the balanced share of rows "
                f"per link), or None for the worst-case capacity; got {self.dispatch_capacity_factor}"
            )
        if self.compiler is not None and self.compiler not in COMPILERS:
            raise ConfigError(f"OverlapConfig.compiler must be one of {COMPILERS} or None, got {self.compiler!r}")
        if self.mhc_recompute_group is not None and self.mhc_recompute_group < 1:
            raise ConfigError(
                f"OverlapConfig.mhc_recompute_group must be >= 1 (or None for no recompute), "
                f"got {self.mhc_recompute_group}"
            )
        if self.grad_reduce not in GRAD_REDUCE_MODES:
            raise ConfigError(f"OverlapConfig.grad_reduce must be one of {GRAD_REDUCE_MODES}, got {self.grad_reduce!r}")
        if isinstance(self.disable_passes, str):
            object.__setattr__(self, "disable_passes", (self.disable_passes,))
        elif not isinstance(self.disable_passes, tuple):
            object.__setattr__(self, "disable_passes", tuple(self.disable_passes))
        if isinstance(self.max_programs, bool) or not isinstance(self.max_programs, int) or self.max_programs < 1:
            raise ConfigError(f"OverlapConfig.max_programs must be an int >= 1, got {self.max_programs!r}")
        if self.shard_params and self.cuda_graphs:
            raise ConfigError("OverlapConfig(shard_params=True, cuda_graphs=True): a gathered parameter lives in "
                              "new memory at every step, which a CUDA graph cannot follow; leave cuda_graphs unset "
                              "(off with shard_params)")
        if self.shard_params and self.autotune:
            raise ConfigError("OverlapConfig(shard_params=True, autotune=True): tuning builds an engine per candidate, "
                              "and the first shards the model's parameters for good; tune without shard_params "
                              "(fxoverlap.tune(model, ...)) and pass dataclasses.replace(tuned, shard_params=True)")
        if not isinstance(self.autotune, bool):
            raise ConfigError(f"OverlapConfig.autotune must be True or False, got {self.autotune!r}")
        if self.expert_dtype is not None and self.expert_dtype not in EXPERT_DTYPES:
            raise ConfigError(f"OverlapConfig.expert_dtype must be one of {EXPERT_DTYPES} or None (the model's "
                              f"dtype), got {self.expert_dtype!r}")
        if not self.keep_gathered_mb >= 0:
            raise ConfigError(f"OverlapConfig.keep_gathered_mb must be >= 0 (MiB; float('inf'): each unit gathered "
                              f"once per step), got {self.keep_gathered_mb}")
        if self.keep_gathered_mb and not self.shard_params:
            raise ConfigError("OverlapConfig.keep_gathered_mb keeps sharded parameters gathered between uses: it needs "
                              "shard_params=True")
        if isinstance(self.unshard_ahead, bool) or not isinstance(self.unshard_ahead, int) or self.unshard_ahead < 1:
            raise ConfigError(f"OverlapConfig.unshard_ahead must be an int >= 1 (uses ahead of the reader a gather "
                              f"is issued), got {self.unshard_ahead!r}")
        if self.unshard_ahead != 1 and not self.shard_params:
            raise ConfigError("OverlapConfig.unshard_ahead places the gathers of sharded parameters: it needs "
                              "shard_params=True")
        if not self.reduce_bucket_mb >= 0:
            raise ConfigError(f"OverlapConfig.reduce_bucket_mb must be >= 0 (MiB), got {self.reduce_bucket_mb}")

    def resolved_chunks(self, device_type: str) -> int:
        """How many chunks each MoE layer's exchange is cut into on ``device_type``."""
        if self.chunks is not None:
            return self.chunks
        return DEFAULT_CUDA_CHUNKS if device_type == "cuda" else 1

    def resolved_min_chunk_exchange_bytes(self, device_type: str, one_microbatch: bool) -> int:
        """Below how many bytes a forward dispatch sends a layer stays whole although
        :meth:`resolved_chunks` > 1 (0: every layer is cut): the per-device default's, in
        programs that run ``one_microbatch`` per call; a set ``chunks`` cuts every layer."""
        if self.chunks is not None or device_type != "cuda" or not one_microbatch:
            return 0
        return DEFAULT_CUDA_ONE_MICROBATCH_MIN_CHUNK_EXCHANGE_BYTES

    def resolved_delay_wgrad(self, device_type: str) -> bool:
        """Whether the backward's weight gradients are split off on ``device_type``."""
        if self.delay_wgrad is not None:
            return self.delay_wgrad
        return DEFAULT_CUDA_DELAY_WGRAD and device_type == "cuda"

    def resolved_sm_carveout(self, device_type: str) -> int | None:
        """The SM carveout the runtime sets on ``device_type`` (None: it leaves torch's)."""
        if self.sm_carveout is not None:
            return self.sm_carveout
        return DEFAULT_CUDA_SM_CARVEOUT if device_type == "cuda" else None

    def resolved_compiler(self, device_type: str) -> str:
        """The compiler for a model whose parameters live on ``device_type``."""
        if self.compiler is not None:
            return self.compiler
        return "inductor" if device_type == "cuda" else "eager"


def _check_field_names(init):
    """Wrap the dataclass's ``__init__`` so an unknown keyword raises :class:`UnknownConfigField`
    with the closest field names, not Python's bare "unexpected keyword argument" TypeError."""

    @functools.wraps(init)  # keeps the signature (inspect follows __wrapped__)
    def __init__(self, *args, **kwargs):
        fields = {f.name for f in dataclasses.fields(OverlapConfig) if f.init}
        if unknown := [k for k in kwargs if k not in fields]:
            raise UnknownConfigField(
                f"OverlapConfig: unknown field {unknown_names(unknown, fields)}; its fields are "
                f"{', '.join(sorted(fields))}")
        init(self, *args, **kwargs)

    return __init__


OverlapConfig.__init__ = _check_field_names(OverlapConfig.__init__)


def refused_fields(config: OverlapConfig, front_end: str, honoured: Iterable[str] = ()) -> dict[str, str]:
    """The fields of ``config`` set to something ``front_end`` cannot honour (a value other than
    the default, where the field's metadata refuses that front end), each with the reason;
    ``honoured``: fields this call does honour after all (``pipeline_schedule`` with ``dp_group``
    reduces gradients)."""
    honoured = set(honoured)
    return {f.name: f.metadata["refused_by"][front_end] for f in dataclasses.fields(config)
            if front_end in f.metadata.get("refused_by", {}) and f.name not in honoured
            and getattr(config, f.name) != f.default}


def field_phase(name: str) -> str:
    """The phase an ``OverlapConfig`` field affects (one of :data:`PHASES`)."""
    return {f.name: f.metadata["phase"] for f in dataclasses.fields(OverlapConfig)}[name]
