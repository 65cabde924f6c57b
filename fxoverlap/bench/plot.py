"""The timeline PNG: which stage ran when on the compute and comm stream of every rank."""

from __future__ import annotations

import os
from collections.abc import Sequence

from fxoverlap.bench.metrics import COMM, COMP

KIND_COLORS = {
    "embed": "#7f7f7f", "attn": "#1f77b4", "dispatch": "#d62728", "experts": "#2ca02c", "mlp": "#2ca02c",
    "combine": "#ff7f0e", "post": "#9467bd", "head": "#8c564b", "recompute": "#e377c2",
}


def plot_timeline(timelines: Sequence[Sequence[dict]], path: str, title: str = "",
                  stage_ms: dict[str, float] | None = None) -> bool:
    """PNG: one row per (rank, stream), a bar per stage call of one step; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        print("[bench] matplotlib is not installed: skipping the timeline PNG "
              "(pip install matplotlib, or the 'bench' extra)", flush=True)
        return False
    rows = [(r, s) for r in range(len(timelines)) for s in (COMP, COMM)]
    end = max((e["end"] for tl in timelines for e in tl), default=1.0) or 1.0
    n = max(len(tl) for tl in timelines) if timelines else 1
    width = min(80.0, max(14.0, n / 12))
    fig, ax = plt.subplots(figsize=(width, 1.0 + 0.9 * len(rows)))
    for y, (rank, stream) in enumerate(rows):
        for e in timelines[rank]:
            if e["stream"] != stream:
                continue
            kind = e["kind"]
            bwd = e["name"].startswith("B")
            ax.broken_barh([(e["start"], max(e["end"] - e["start"], end * 1e-4))], (y - 0.38, 0.76),
                           facecolors=KIND_COLORS.get(kind, "#bcbd22"), edgecolor="black", linewidth=0.2,
                           hatch="////" if bwd else None, alpha=0.9)
            if e["end"] - e["start"] > end * 0.006:
                ax.text((e["start"] + e["end"]) / 2, y, e["name"], ha="center", va="center", fontsize=4.5,
                        rotation=90, clip_on=True)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"rank {r} {s}" for r, s in rows])
    ax.invert_yaxis()
    ax.set_xlim(0, end)
    ax.set_xlabel("ms since the step's start on each rank (events around each stage: a stage's bar also "
                  "spans its wait for the stream's earlier work and the cross-stream events)")
    handles = [Patch(facecolor=c, label=k) for k, c in KIND_COLORS.items() if k != "mlp"]
    handles.append(Patch(facecolor="white", edgecolor="black", hatch="////", label="backward"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.12 - 0.25 / len(rows)), fontsize=7,
              ncol=len(handles), frameon=False)
    if stage_ms:
        title += f"   (serial sum of stages {sum(stage_ms.values()):.1f} ms, this step {end:.1f} ms)"
    ax.set_title(title, fontsize=9)
    ax.grid(axis="x", linewidth=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return True
