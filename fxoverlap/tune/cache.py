"""The persistent result: one JSON file per key under ``$FXOVERLAP_TUNE_CACHE`` (default
``~/.cache/fxoverlap/tune``), written atomically (:class:`TuneCache`).

The key (:func:`cache_key`) holds the model's signature, the microbatches' shapes and dtypes, the
device name, the world/EP/DP sizes, the link (real, or the emulated link's numbers), the torch
version, the config's other fields and the candidate list. A hit is used without timing, logged on
``fxoverlap.tune`` (``TORCH_LOGS="fxoverlap"``) and as the trace artifact ``fxoverlap_tune_cache``
(:func:`log_cache_use`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from fxoverlap.config import OverlapConfig
from fxoverlap.tune.candidates import TUNED_FIELDS, Candidate

log = logging.getLogger("fxoverlap.tune")

#: Environment variable naming the cache folder (default ``~/.cache/fxoverlap/tune``).
CACHE_ENV = "FXOVERLAP_TUNE_CACHE"
#: Bumped when the cache's key or entry layout changes: older entries are then misses.
CACHE_VERSION = 1


def digest(obj: Any) -> str:
    """A stable hex digest of a JSON-able value."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def model_signature(model: nn.Module) -> str:
    """A digest of the parameters' and buffers' names, shapes and dtypes and the modules' types."""
    parts = [("p", n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in model.named_parameters()]
    parts += [("b", n, tuple(b.shape), str(b.dtype)) for n, b in model.named_buffers()]
    parts += [("m", n, f"{type(m).__module__}.{type(m).__qualname__}") for n, m in model.named_modules()]
    return digest(parts)


def group_size(group) -> int:
    """The size of ``group`` (None: 1; a stand-in group: its ``size()``; one rank without ``dist``: 1)."""
    if group is None:
        return 1
    if hasattr(group, "size") and not isinstance(group, dist.ProcessGroup):
        return int(group.size())
    return dist.get_world_size(group) if dist.is_initialized() else 1


def link_key(ep_group) -> dict:
    """The link the exchanges run over: an emulated one's numbers (``EmulatedGroup.link``), or
    the real group's backend and size."""
    link = getattr(ep_group, "link", None)
    if link is not None and hasattr(link, "describe"):
        return {"kind": "emulated", **link.describe()}
    if ep_group is None:
        return {"kind": "none"}
    if isinstance(ep_group, dist.ProcessGroup):
        return {"kind": "real", "backend": str(dist.get_backend(ep_group)), "size": group_size(ep_group)}
    return {"kind": type(ep_group).__name__, "link": None}


def _tensors(mb) -> list[torch.Tensor]:
    if isinstance(mb, torch.Tensor):
        return [mb]
    if isinstance(mb, Mapping):
        return [v for _, v in sorted(mb.items()) if isinstance(v, torch.Tensor)]
    return [t for t in mb if isinstance(t, torch.Tensor)]


def cache_key(model: nn.Module, microbatches: Sequence, *, device: torch.device, ep_group=None, dp_group=None,
              base: OverlapConfig, forward_only: bool, candidates: Sequence[Candidate]) -> dict:
    """What a tuned result depends on (docs/tune.md, "The cache"), as a JSON-able dict."""
    others = {f.name: repr(getattr(base, f.name)) for f in dataclasses.fields(base)
              if f.name not in TUNED_FIELDS and f.name not in ("autotune", "progress")}
    return {
        "version": CACHE_VERSION,
        "model": model_signature(model),
        "microbatches": [[(tuple(t.shape), str(t.dtype)) for t in _tensors(mb)] for mb in microbatches],
        "forward_only": forward_only,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
        "world": dist.get_world_size() if dist.is_initialized() else 1,
        "ep": group_size(ep_group),
        "dp": group_size(dp_group),
        "link": link_key(ep_group),
        "torch": torch.__version__,
        "config": others,
        "candidates": digest([c.fields() for c in candidates]),
    }


def cache_dir() -> str:
    return os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "fxoverlap", "tune")


class TuneCache:
    """One JSON file per key digest under ``folder`` (default :func:`cache_dir`)."""

    def __init__(self, folder: str | None = None):
        self.folder = folder or cache_dir()

    def path(self, key: Mapping) -> str:
        return os.path.join(self.folder, f"{digest(key)[:32]}.json")

    def load(self, key: Mapping) -> dict | None:
        """The entry stored under ``key`` (its own key checked equal), or None."""
        path = self.path(key)
        try:
            with open(path) as f:
                entry = json.load(f)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            log.info("fxoverlap.tune: ignoring unreadable cache entry %s (%s)", path, e)
            return None
        if entry.get("key") != json.loads(json.dumps(key, default=str)):
            log.info("fxoverlap.tune: cache entry %s holds another key; ignored", path)
            return None
        return entry

    def store(self, key: Mapping, choice: Candidate, table: list[dict]) -> str:
        """Write the entry atomically (a temporary file in the folder, then ``os.replace``)."""
        os.makedirs(self.folder, exist_ok=True)
        path = self.path(key)
        entry = {"key": key, "choice": choice.fields(), "table": table,
                 "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=".tmp-", suffix=".json")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(entry, f, indent=1, default=str)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return path


def log_cache_use(path: str, key: Mapping, choice: Candidate) -> None:
    """Say which entry was used: on the ``fxoverlap.tune`` log and as a ``TORCH_TRACE`` artifact."""
    log.info("fxoverlap.tune: using cached entry %s (model %s, device %s, link %s): %s", path, key["model"][:12],
             key["device"], key["link"].get("kind"), choice.label())
    torch._logging.trace_structured(
        "artifact", metadata_fn=lambda: {"name": "fxoverlap_tune_cache", "encoding": "json"},
        payload_fn=lambda: json.dumps({"path": path, "key": key, "choice": choice.fields()}, default=str),
        expect_trace_id=False)
