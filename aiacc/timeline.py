"""A Chrome / Perfetto trace of what the engine did.

Every tensor gets a track (a "thread" in the trace's terms, named after the
tensor) with its phases as complete events: ``queued`` (submitted, waiting
for a cycle), ``negotiate`` (waiting for every rank), ``pack``,
``communicate``, ``unpack``. Every cycle is an event on the ``cycles`` track
and every fused buffer one on the ``buffers`` track. Open the file at
https://ui.perfetto.dev or chrome://tracing.

The file is a JSON array written as events happen; ``close`` ends it.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Dict, Optional

__all__ = ["Timeline"]


class Timeline:
    def __init__(self, path: str, rank: int):
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        self._file = open(path, "wb", buffering=1 << 16)  # noqa: SIM115 - closed in close()
        self._file.write(b"[\n")
        self._lock = threading.Lock()
        self._tracks: Dict[str, int] = {}
        self._pid = rank
        self._t0 = time.perf_counter()
        self._closed = False
        self._meta("process_name", 0, {"name": f"aiacc rank {rank}"})
        self._track("cycles")
        self._track("buffers")

    def _us(self, t: float) -> float:
        return round((t - self._t0) * 1e6, 3)

    def _write(self, event: dict) -> None:
        self._file.write(json.dumps(event, separators=(",", ":")).encode() + b",\n")

    def _meta(self, what: str, tid: int, args: dict) -> None:
        self._write({"ph": "M", "name": what, "pid": self._pid, "tid": tid, "args": args})

    def _track(self, name: str) -> int:
        tid = self._tracks.get(name)
        if tid is None:
            tid = self._tracks[name] = len(self._tracks) + 1
            self._meta("thread_name", tid, {"name": name})
            self._meta("thread_sort_index", tid, {"sort_index": tid})
        return tid

    def span(self, track: str, name: str, start: float, end: float, args: Optional[dict] = None) -> None:
        """One complete event from ``start`` to ``end`` (``time.perf_counter`` seconds)."""
        if self._closed:
            return
        event = {"ph": "X", "name": name, "pid": self._pid, "tid": self._track(track),
                 "ts": self._us(start), "dur": max(0.0, round((end - start) * 1e6, 3))}
        if args:
            event["args"] = args
        with self._lock:
            self._write(event)

    def tensor(self, name: str, phases, args: Optional[dict] = None) -> None:
        """All phases of one tensor: ``phases`` is [(phase, start, end), ...]."""
        for phase, start, end in phases:
            if start is not None and end is not None:
                self.span(name, phase, start, end, args if phase == "communicate" else None)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._write({"ph": "M", "name": "aiacc_end", "pid": self._pid, "tid": 0, "args": {}})
            # replace the trailing ",\n" so the array is valid JSON
            self._file.seek(self._file.tell() - 2)
            self._file.write(b"\n]\n")
            self._file.truncate()
            self._file.close()
