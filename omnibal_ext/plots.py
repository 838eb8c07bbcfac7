"""Figures for reports (matplotlib, Agg backend: no display needed)."""
from __future__ import annotations

from typing import Mapping, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

FWD_COLOUR, BWD_COLOUR = "#4C72B0", "#DD8452"


def plot_timeline(sim_result, path: str, title: str | None = None) -> str:
    """Stages (rows) x time (seconds): forward blue, backward orange; micro-batch number inside.

    sim_result: ``omnibal_ext.model.simulate.SimResult``. Returns ``path``.
    """
    P = sim_result.num_stages
    fig, ax = plt.subplots(figsize=(12, 0.45 * P + 1.5))
    t0 = min((e.start_s for e in sim_result.events), default=0.0)
    V = sim_result.num_chunks
    groups: dict[tuple, list] = {}
    for e in sim_result.events:
        groups.setdefault((e.stage, e.kind, e.chunk), []).append((e.start_s - t0, e.end_s - e.start_s))
    for (stage, kind, chunk), spans in groups.items():
        alpha = 1.0 - 0.5 * chunk / (V - 1) if V > 1 else 1.0  # later chunks lighter
        ax.broken_barh(spans, (stage - 0.4, 0.8), facecolors=FWD_COLOUR if kind == "fwd" else BWD_COLOUR,
                       alpha=alpha, edgecolor="black", linewidth=0.3)
    if len(sim_result.events) <= 200:
        for e in sim_result.events:
            ax.text((e.start_s + e.end_s) / 2 - t0, e.stage, str(e.microbatch), ha="center", va="center", fontsize=6)
    ax.set_yticks(range(P))
    ax.set_yticklabels([f"stage {i}" for i in range(P)])
    ax.invert_yaxis()
    ax.set_xlabel("time (s)")
    ax.set_title(title or f"iteration {sim_result.iteration_s:.3f} s, bubble {sim_result.bubble_fraction:.1%}")
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=FWD_COLOUR), plt.Rectangle((0, 0), 1, 1, color=BWD_COLOUR)],
              labels=["forward", "backward"], loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_stage_times(stage_times: Mapping[str, Sequence[float]], path: str, title: str = "stage time per micro-batch") -> str:
    """Grouped bars: per stage, the time (seconds) of each named layout (e.g. default vs balanced)."""
    names = list(stage_times)
    if not names:
        raise ValueError("plot_stage_times: no layouts given")
    P = max(len(v) for v in stage_times.values())
    width = 0.8 / len(names)
    fig, ax = plt.subplots(figsize=(max(6, 0.5 * P * len(names) + 2), 4))
    for k, name in enumerate(names):
        times = list(stage_times[name])
        ax.bar([i + (k - (len(names) - 1) / 2) * width for i in range(len(times))], times, width=width, label=name)
    ax.set_xticks(range(P))
    ax.set_xlabel("pipeline stage")
    ax.set_ylabel("forward + backward (s)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_curves(panels: Sequence[tuple[str, Mapping[str, tuple[Sequence[float], Sequence[float]]]]], path: str,
                xlabel: str = "iteration", title: str | None = None) -> str:
    """Panels side by side, one per (y label, {curve name: (x values, y values)}), the same curve names in the
    same colours in every panel. Returns ``path``."""
    if not panels:
        raise ValueError("plot_curves: no panels given")
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    for ax, (ylabel, curves) in zip(axes[0], panels):
        for name, (x, y) in curves.items():
            ax.plot(list(x), list(y), label=name, linewidth=1.4)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
