"""Chrome trace JSON from rank timelines (open in https://ui.perfetto.dev or chrome://tracing).

One process per rank (named with its stage and replica), one thread for its actions; idle waits
appear as events named ``bubble: wait ...`` in the ``bubble`` category, so they can be selected
and summed in Perfetto.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bubbleguard.pipeline.timeline import EventKind, TimelineEvent

__all__ = ["chrome_trace", "write_chrome_trace"]

_CATEGORY = {EventKind.IDLE: "bubble"}


def chrome_trace(events: Sequence[TimelineEvent]) -> dict[str, Any]:
    """Build the Chrome trace object; times are microseconds from the earliest event."""
    if not events:
        return {"traceEvents": [], "displayTimeUnit": "ms"}
    origin = min(e.start_s for e in events)
    out: list[dict[str, Any]] = []
    ranks = sorted({(e.rank, e.stage, e.replica) for e in events})
    for rank, stage, replica in ranks:
        out.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
                    "args": {"name": f"rank {rank} (stage {stage}, replica {replica})"}})
        out.append({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0,
                    "args": {"sort_index": rank}})
    for e in events:
        name = f"bubble: {e.name}" if e.kind == EventKind.IDLE else e.name
        out.append({
            "name": name,
            "cat": _CATEGORY.get(e.kind, e.kind),
            "ph": "X",
            "pid": e.rank,
            "tid": 0,
            "ts": (e.start_s - origin) * 1e6,
            "dur": max(e.duration_s, 0.0) * 1e6,
            "args": {"step": e.step, "stage": e.stage, "action_index": e.action_index},
        })
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def write_chrome_trace(path: str | Path, events: Sequence[TimelineEvent]) -> None:
    """Write the trace of ``events`` to ``path`` (parent directories are created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(chrome_trace(events)))
