"""The backend's options: ``torch.compile(model, backend="fxoverlap", mode=..., options={...})``
(or keyword options of a :class:`fxoverlap.backend.Backend`) -> :class:`OverlapConfig`.

Keys that name an ``OverlapConfig`` field set it, keys of ``torch._inductor.config`` are Inductor
options for the compiled stages; the values are checked by the config itself
(``OverlapConfig.__post_init__``, ``check_disable_passes``), so both front ends share one check.
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType

from fxoverlap.config import BACKEND, ConfigError, OverlapConfig, UnknownConfigField, refused_fields, unknown_names
from fxoverlap.pipeline import check_disable_passes

__all__ = ["backend_config"]

_ALIASES = MappingProxyType({"overlap": "side_stages"})

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
    field the backend cannot honour (each field's metadata says so, ``config.refused_fields``:
    ``record_memory``, ``grad_reduce``, ``reduce_bucket_mb``, ``dispatch_capacity_factor``,
    ``max_programs``, and the merged steps' ``chunks_in_merged_steps`` and ``expert_wgrad_slot``;
    use ``fxoverlap.optimize`` for them). ``mode="reduce-overhead"``
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
        raise UnknownConfigField(
            f"fxoverlap backend: unknown option {unknown_names(unknown, {*fields, *_ALIASES, *inductor_names})}: "
            f"an option is an OverlapConfig field "
            f"({', '.join(sorted(fields))}; 'overlap' is side_stages) or an Inductor option (a key of "
            f"torch._inductor.config.get_config_copy(), dotted for its sub-configs: 'triton.cudagraphs')")
    refused = {k: why for k, why in refused_fields(OverlapConfig(**cfg), BACKEND).items() if k in cfg}
    if refused:
        raise ConfigError(
            f"fxoverlap backend: cannot honour {', '.join(f'{k}={cfg[k]!r}' for k in refused)}: "
            + "; ".join(f"{k}: {why}" for k, why in refused.items())
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
