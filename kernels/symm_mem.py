"""The ``symm_mem`` transport of ``static_ep.py``: real rows written straight into the peers' memory.

Every rank's landing buffers come from ``torch.distributed._symmetric_memory``
(``empty`` + ``rendezvous``, then each peer's copy through ``get_buffer``), so a kernel on
one GPU can store into another's. For each outgoing slot that holds a row, a Triton
kernel stores the row at row ``me * C + j`` of the destination's landing buffer; then a
device-side barrier (``barrier`` on the buffer's handle) tells every rank that its buffer
is complete. Nothing is read on the host and only real rows cross the link (``padded``
moves ``ep * C`` rows per exchange however few are real). CUDA, within one host.

Buffers: parts of one exchange sit side by side in one byte buffer (each at a 16-byte
aligned column; the kernel copies each in the widest word that divides its row), two
buffers per shape used in turn. Reuse is safe because every exchange ends with a barrier and the ops
copy their landing rows out right after it, on the same stream: a peer can write a
buffer again only after passing the barrier of the *next* exchange of that shape,
which this rank reaches only after its copy-out. This needs every rank to issue the
exchanges in the same order on one stream (the program's comm stream). The host-side
turn counter does not survive CUDA-graph replay: comm stages stay eager.
"""

from __future__ import annotations

import os
import socket
import warnings
from collections.abc import Sequence

import torch
import torch.distributed as dist

from fxoverlap.kernels.a2a import group_name_of, one_rank, world_size
from fxoverlap.kernels.static_ep import masked_rows

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

if triton is not None:

    @triton.jit
    def _push_rows_kernel(src, sel, dst_ptrs, me, cap, src_stride, dst_stride, col_off, width,
                          BLOCK: tl.constexpr):
        slot = tl.program_id(0)
        row = tl.load(sel + slot)
        if row >= 0:
            peer = slot // cap
            base = tl.load(dst_ptrs + peer).to(tl.pointer_type(src.dtype.element_ty))
            dst = base + (me * cap + slot % cap).to(tl.int64) * dst_stride + col_off
            src_row = src + row.to(tl.int64) * src_stride
            for c in range(0, width, BLOCK):
                cols = c + tl.arange(0, BLOCK)
                mask = cols < width
                tl.store(dst + cols, tl.load(src_row + cols, mask=mask), mask=mask)


_WORDS = (torch.int64, torch.int32, torch.int16, torch.uint8)


class _Buffers:
    """Two symmetric landing buffers of one shape, their handles and peer pointer tables."""

    def __init__(self, group: dist.ProcessGroup, rows: int, cols: int, dtype: torch.dtype, device: torch.device):
        import torch.distributed._symmetric_memory as symm

        # We never use multimem; NVLink multicast objects can take a shared host's GPUs down.
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        self.bufs, self.handles, self.ptrs = [], [], []
        for _ in range(2):
            buf = symm.empty(rows, cols, dtype=dtype, device=device)
            handle = symm.rendezvous(buf, group)
            peers = [handle.get_buffer(p, buf.shape, dtype).data_ptr() for p in range(group.size())]
            self.bufs.append(buf)
            self.handles.append(handle)
            self.ptrs.append(torch.tensor(peers, dtype=torch.int64, device=device))
        self.turn = 0

    def next(self) -> int:
        self.turn ^= 1
        return self.turn


_pools: dict[tuple, _Buffers] = {}


def _word_dtype(nbytes: int) -> torch.dtype:
    """The widest machine word that divides a row of ``nbytes``: the copy kernel's unit."""
    return next(w for w in _WORDS if nbytes % w.itemsize == 0)


def transport(parts: Sequence[tuple[torch.Tensor, torch.Tensor]], group, capacity: int) -> list[torch.Tensor]:
    """``static_ep`` transport contract. The landing views are valid until the next exchange
    of the same shape; rows past a sender's real rows hold stale data (never read)."""
    if one_rank(group):  # one rank (or a stand-in's): the outgoing slots are the landing slots
        return [masked_rows(src, sel) for src, sel in parts]
    ep, me = world_size(group), dist.get_rank(group)
    # Parts sit side by side in one byte buffer, each at a 16-byte aligned column, so
    # each can be viewed back as its own dtype in place.
    spans, stride = [], 0
    for src, _ in parts:
        nbytes = src.shape[1] * src.element_size()
        spans.append((stride, nbytes))
        stride += -(-nbytes // 16) * 16
    device = parts[0][0].device
    key = (group_name_of(group), ep * capacity, stride, device)
    pool = _pools.get(key)
    if pool is None:
        pool = _pools[key] = _Buffers(group, ep * capacity, stride, torch.uint8, device)
    turn = pool.next()
    landing = pool.bufs[turn]
    for (src, sel), (off, nbytes) in zip(parts, spans):
        word = _word_dtype(nbytes)
        size = word.itemsize
        words = src.contiguous().view(torch.uint8).view(word)
        block = min(1024, triton.next_power_of_2(max(nbytes // size, 16)))
        _push_rows_kernel[(ep * capacity,)](
            words, sel.contiguous(), pool.ptrs[turn], me, capacity, words.stride(0), stride // size, off // size,
            nbytes // size, BLOCK=block)
    pool.handles[turn].barrier(channel=0)
    return [landing[:, off:off + nbytes].view(src.dtype) for (src, _), (off, nbytes) in zip(parts, spans)]


_usable: dict[str, tuple[bool, str]] = {}


def usable(group: dist.ProcessGroup | None, device: torch.device) -> tuple[bool, str]:
    """Whether this transport can run for ``group`` on ``device``, and if not, why.

    Collective the first time per group (the ranks' host names are gathered), so every
    rank must ask at the same point (they do: each builds the same plan).
    """
    if device.type != "cuda":
        return False, f"the model is on {device.type}; symmetric memory needs CUDA"
    if one_rank(group):
        return False, ("there is no expert-parallel process group (one rank has nothing to exchange)" if group is None
                       else f"the expert-parallel group {group!r} is a one-rank stand-in (nothing to map)")
    if triton is None:
        return False, "Triton is not installed (the row-copy kernel is written in Triton)"
    try:
        import torch.distributed._symmetric_memory as symm
    except ImportError as e:
        return False, f"torch.distributed._symmetric_memory cannot be imported ({e})"
    name = group.group_name
    if name not in _usable:
        hosts: list[str | None] = [None] * group.size()
        dist.all_gather_object(hosts, socket.gethostname(), group=group)
        if len(set(hosts)) > 1:
            _usable[name] = (False, f"the EP group spans hosts {sorted(set(hosts))}; symmetric memory maps the "
                                    f"peers' GPU memory within one host only")
        else:
            with warnings.catch_warnings():  # needed before torch 2.12, a deprecated no-op after
                warnings.simplefilter("ignore", FutureWarning)
                if hasattr(symm, "enable_symm_mem_for_group"):
                    symm.enable_symm_mem_for_group(name)
            _usable[name] = (True, "")
    return _usable[name]
