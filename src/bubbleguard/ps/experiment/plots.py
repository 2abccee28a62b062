"""Accuracy curves of an experiment, with kills and recoveries marked (matplotlib, Agg).

One figure per x-axis (time or updates): the first panel overlays every run, coloured by
strategy; then one panel per strategy, one line per seed, with each kill (red dashed), recovery
(green dotted) and chain re-join (blue dotted) marked, and the outage shaded. On the updates
axis an event sits at the update count of the last evaluation before it.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")

from matplotlib import pyplot as plt  # noqa: E402  (the backend must be chosen first)

from bubbleguard.ps.core.metrics import outages  # noqa: E402
from bubbleguard.ps.experiment.runner import RunResult  # noqa: E402

_EVENT_STYLE = {
    "kill": {"color": "tab:red", "linestyle": "--"},
    "recovered": {"color": "tab:green", "linestyle": ":"},
    "rejoined": {"color": "tab:blue", "linestyle": ":"},
    "worker_restarted": {"color": "tab:purple", "linestyle": ":"},
}


def _x_of_time(run: RunResult, t: float, x: str) -> float:
    """Where the absolute time ``t`` sits on the axis ``x``."""
    rel = t - run.t0
    if x == "time":
        return rel
    before = [s.updates for s in run.samples if s.time <= rel]
    return float(before[-1]) if before else 0.0


def _curve(run: RunResult, x: str) -> tuple[list[float], list[float]]:
    # Unreadable samples stay in as nan so the line breaks across an outage.
    xs = [s.time if x == "time" else float(s.updates) for s in run.samples]
    return xs, [s.accuracy for s in run.samples]


def plot_accuracy(runs: list[RunResult], path: Path, *, x: str = "time") -> None:
    """Write the figure for axis ``x`` (``time`` or ``updates``) to ``path``."""
    if x not in ("time", "updates"):
        raise ValueError(f"x must be 'time' or 'updates', got {x!r}")
    strategies = list(dict.fromkeys(r.strategy for r in runs))
    colors = {s: f"C{i}" for i, s in enumerate(strategies)}
    fig, axes = plt.subplots(
        len(strategies) + 1, 1, figsize=(9, 2.6 * (len(strategies) + 1)), sharex=True, squeeze=False
    )
    overlay = axes[0][0]
    for strategy in strategies:
        for i, run in enumerate(r for r in runs if r.strategy == strategy):
            overlay.plot(*_curve(run, x), color=colors[strategy], alpha=0.8, lw=1, label=strategy if i == 0 else None)
    overlay.set_title("all runs")
    overlay.legend(loc="lower right", fontsize="small")
    for ax, strategy in zip((row[0] for row in axes[1:]), strategies, strict=True):
        for run in (r for r in runs if r.strategy == strategy):
            ax.plot(*_curve(run, x), lw=1, label=f"seed {run.seed}")
            for outage in outages(run.events):
                end = outage.end if outage.end is not None else run.t0 + run.config.duration_s
                ax.axvspan(_x_of_time(run, outage.start, x), _x_of_time(run, end, x), color="tab:red", alpha=0.07)
            for event in run.events:
                ax.axvline(_x_of_time(run, event.time, x), lw=0.8, **_EVENT_STYLE[event.kind])
        ax.set_title(strategy)
        ax.legend(loc="lower right", fontsize="small")
    for row in axes:
        row[0].set_ylabel("test accuracy")
        row[0].set_ylim(0, 1)
        row[0].grid(alpha=0.3)
    axes[-1][0].set_xlabel("seconds" if x == "time" else "updates applied")
    fig.suptitle(
        f"accuracy vs {x}: red dashed = kill, green dotted = serving again, blue dotted = chain re-joined"
    )
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)
