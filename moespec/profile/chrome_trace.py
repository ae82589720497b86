"""Chrome / Perfetto trace (JSON "trace event format") of one decode step per strategy.

One process per strategy; in each, a "compute" track (one span per decoder layer, with the MoE
block's stalls and expert computes nested inside) and a "copy" track (one span per expert copy,
demand or prefetch; with the experts on disk it is the "disk read" lane: one span per row read
from the store file into the RAM tier); with ``--on-miss host|auto`` a "host" track (one span per expert computed on
the host pool beside the device). Open the file in https://ui.perfetto.dev or chrome://tracing.
Timestamps are microseconds from the start of the step.
"""

from __future__ import annotations

import json
import os

from moespec.fsutil import atomic_path
from moespec.profile.run import Timeline

COMPUTE_TID, COPY_TID, HOST_TID = 1, 2, 3


def trace_events(timelines: list[Timeline]) -> list[dict]:
    """The trace events of ``timelines`` (one process each)."""
    events: list[dict] = []
    for pid, tl in enumerate(timelines, start=1):
        label = f"{tl.strategy} (prompt {tl.prompt_len}, decode step {tl.step}, {tl.wall_ms:.2f} ms)"
        events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": label}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
        lanes = [(COMPUTE_TID, "compute"), (COPY_TID, tl.copy_lane)] + ([(HOST_TID, "host")] if tl.host else [])
        for tid, name in lanes:
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}})

        def span(name, cat, tid, start_ms, dur_ms, args):
            events.append({"name": name, "cat": cat, "ph": "X", "pid": pid, "tid": tid,  # noqa: B023
                           "ts": round(start_ms * 1e3, 3), "dur": round(max(dur_ms, 0.0) * 1e3, 3), "args": args})

        for layer, start, dur in tl.layers:
            span(f"layer {layer}", "layer", COMPUTE_TID, start, dur, {"layer": layer})
        for layer, what, start, dur in tl.inner:
            span(what, what, COMPUTE_TID, start, dur, {"layer": layer})
        for layer, expert, kind, start, dur, nbytes in tl.copies:
            span(f"L{layer} E{expert}", kind, COPY_TID, start, dur,
                 {"layer": layer, "expert": expert, "kind": kind, "bytes": nbytes})
        for layer, start, dur in tl.host:
            span(f"L{layer} host", "host", HOST_TID, start, dur, {"layer": layer})
    return events


def write_chrome_trace(timelines: list[Timeline], path: str | os.PathLike) -> None:
    """Write ``timelines`` as a Chrome trace JSON file (atomically)."""
    obj = {"traceEvents": trace_events(timelines), "displayTimeUnit": "ms",
           "otherData": {"producer": "moespec profile"}}
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj), encoding="utf-8")
