"""The backend's options: ``torch.compile(model, backend="fxoverlap", mode=..., options={...})``
(or keyword options of a :class:`fxoverlap.backend.Backend`) -> :class:`OverlapConfig`.

Keys that name an ``OverlapConfig`` field set it, keys of ``torch._inductor.config`` are Inductor
options for the compiled stages; the values are checked by the config itself
(``OverlapConfig.__post_init__``, ``check_disable_passes``), so both front ends share one check.
"""

from __future__ import annotations

import dataclasses
import difflib
from types import MappingProxyType

from fxoverlap.config import ConfigError, OverlapConfig
from fxoverlap.pipeline import check_disable_passes

__all__ = ["UNSUPPORTED_FIELDS", "backend_config"]

_ALIASES = MappingProxyType({"overlap": "side_stages"})

# OverlapConfig fields the backend cannot honour (a set value would be silently ignored), and why
UNSUPPORTED_FIELDS = MappingProxyType({
    "record_memory": "the memory trace is engine.memory_trace, which only fxoverlap.optimize keeps",
    "grad_reduce": "the backend reduces no gradients over data parallelism (optimize(..., dp_group=...) does)",
    "reduce_bucket_mb": "the backend reduces no gradients over data parallelism (optimize(..., dp_group=...) does)",
    "dispatch_capacity_factor": "it needs a check of the overflow flags after each step, which "
                                "fxoverlap.optimize makes and the backend does not",
    "chunks_in_merged_steps": "the backend runs one microbatch per call, so its program has no merged steps "
                              "(its layers run the chunks anyway)",
    "expert_wgrad_slot": "the backend runs one microbatch per call, so its program has no merged steps",
})


def _inductor_options() -> set[str]:
    """The names ``torch.compile(options=...)`` takes for Inductor: the keys of
    ``torch._inductor.config`` (dotted for its sub-configs: ``"triton.cudagraphs"``)."""
    import torch._inductor.config as inductor_config

    return set(inductor_config.get_config_copy())


def backend_config(options: dict | None = None, mode: str | None = None, **kwargs) -> OverlapConfig:
    """The :class:`OverlapConfig` for ``torch.compile(model, backend="fxoverlap", mode=..., options=...)``.

    Keys of ``options`` (and keyword options of ````Backend(...)````)
    that name an ``OverlapConfig`` field set it (``overlap`` is ``side_stages``); keys of
    ``torch._inductor.config`` are Inductor options for the compiled stages
    (``compile_options``), as ``torch.compile(options=...)`` passes them to Inductor. Any other
    key raises :class:`~fxoverlap.config.ConfigError` naming it and its close matches, as does a
    field the backend cannot honour (:data:`UNSUPPORTED_FIELDS`: ``record_memory``,
    ``grad_reduce``, ``reduce_bucket_mb``, ``dispatch_capacity_factor``, and the merged steps'
    ``chunks_in_merged_steps`` and ``expert_wgrad_slot``; use ``fxoverlap.optimize`` for them). ``mode="reduce-overhead"``
    turns on CUDA graphs; ``mode="max-autotune"`` Inductor's autotuning.
    """
    fields = {f.name: f for f in dataclasses.fields(OverlapConfig)}
    inductor_names = _inductor_options()
    cfg: dict = {}
    inductor_opts: dict = {}
    unknown: list[str] = []
    for k, v in {**(options or {}), **kwargs}.items():
        k = _ALIASES.get(k, k)
        if k in fields:
            cfg[k] = v
        elif k in inductor_names:
            inductor_opts[k] = v
        else:
            unknown.append(k)
    if unknown:
        known = sorted({*fields, *_ALIASES, *inductor_names})
        lines = []
        for k in unknown:
            close = difflib.get_close_matches(str(k), known, n=3)
            lines.append(f"{k!r}" + (f" (did you mean {', '.join(map(repr, close))}?)" if close else ""))
        raise ConfigError(
            f"fxoverlap backend: unknown option {', '.join(lines)}: an option is an OverlapConfig field "
            f"({', '.join(sorted(fields))}; 'overlap' is side_stages) or an Inductor option (a key of "
            f"torch._inductor.config.get_config_copy(), dotted for its sub-configs: 'triton.cudagraphs')")
    refused = [k for k in UNSUPPORTED_FIELDS if k in cfg and cfg[k] != fields[k].default]
    if refused:
        raise ConfigError(
            f"fxoverlap backend: cannot honour {', '.join(f'{k}={cfg[k]!r}' for k in refused)}: "
            + "; ".join(f"{k}: {UNSUPPORTED_FIELDS[k]}" for k in refused)
            + ". Use fxoverlap.optimize(model, ep_group, OverlapConfig(...)) for them")
    if mode == "reduce-overhead":
        cfg.setdefault("cuda_graphs", True)
    elif mode in ("max-autotune", "max-autotune-no-cudagraphs"):
        inductor_opts.setdefault("max_autotune", True)
    elif mode not in (None, "default"):
        raise ConfigError(f"fxoverlap backend: unknown mode {mode!r}")
    if inductor_opts:
        cfg["compile_options"] = {**(cfg.get("compile_options") or {}), **inductor_opts}
    config = OverlapConfig(**cfg)
    check_disable_passes(config.disable_passes)  # an error for the user, not a fallback
    return config
