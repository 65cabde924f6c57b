"""The ``padded`` transport of ``static_ep.py``: one equal-split ``all_to_all_single``.

Each rank sends every peer exactly ``C`` rows (its real rows, then zero rows), so the
split sizes are known at capture time and nothing is read on the host; gloo and NCCL
both run it. It costs the padding's bandwidth: ``ep * C`` rows leave each rank per
exchange however few are real. Several parts (rows, routing ids, weights) travel
packed as bytes in one all-to-all.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fxoverlap.kernels.a2a import world_size
from fxoverlap.kernels.dedup import _all_to_all
from fxoverlap.kernels.static_ep import masked_rows


def transport(parts: Sequence[tuple[torch.Tensor, torch.Tensor]], group, capacity: int) -> list[torch.Tensor]:
    """``static_ep`` transport contract; the landing rows past a sender's real rows are zero."""
    splits = [capacity] * world_size(group)
    return _all_to_all(splits, [masked_rows(src, sel) for src, sel in parts], splits, group)
