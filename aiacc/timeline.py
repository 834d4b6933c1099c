"""A Chrome / Perfetto trace of what the engine did.

Every tensor gets a track (a "thread" in the trace's terms) named ``<op>.<name>`` as Horovod's
PyTorch and MXNet cores name their ops (``allreduce.fc.weight``, ``broadcast.epoch``), with its phases
as complete events, named as Horovod's timeline names its activities (the layout differs: a track per tensor here, a process there): ``QUEUE``
(submitted, waiting for a cycle), ``NEGOTIATE_<OP>`` (waiting for every rank;
``NEGOTIATE_ALLREDUCE``, ...), ``MEMCPY_IN_FUSION_BUFFER`` (pack), ``<OP>`` (the
collective itself: ``ALLREDUCE``, ``ALLGATHER``, ...) and
``MEMCPY_OUT_FUSION_BUFFER`` (unpack). Every cycle is an event on the ``cycles``
track (with ``mark_cycles``, also a ``CYCLE_START`` instant, as Horovod's
``HOROVOD_TIMELINE_MARK_CYCLES``) and every fused buffer one on the ``buffers``
track. Open the file at https://ui.perfetto.dev or chrome://tracing.

The file is a JSON array written as events happen, flushed after every engine
cycle that wrote something, and a valid JSON array after every flush (Horovod's
writer does the same): it can be read while the job runs, and after a job that
was aborted or killed. Buffers in flight together (credit) go on tracks
``buffers``, ``buffers 2``, ...: a viewer drops an event that partly overlaps
another on its track.
"""

from __future__ import annotations

import errno
import json
import os
import threading
import time
from typing import Dict, Optional

__all__ = ["Timeline", "QUEUE", "PACK", "UNPACK", "DYNAMIC_TIMELINE", "negotiate_phase", "op_phase", "track_name"]

# Horovod's HOROVOD_TIMELINE=DYNAMIC: no file at start, the script starts one (start_timeline)
DYNAMIC_TIMELINE = "DYNAMIC"

# the phases of a tensor, by Horovod's activity names
QUEUE = "QUEUE"
PACK = "MEMCPY_IN_FUSION_BUFFER"
UNPACK = "MEMCPY_OUT_FUSION_BUFFER"


def op_phase(kind) -> str:
    """The phase of the collective itself: ``ALLREDUCE`` for an allreduce (a ``Collective``)."""
    return kind.name


def track_name(kind, name: str) -> str:
    """The track of a tensor: ``allreduce.<name>`` for an allreduce, the name Horovod's PyTorch core gives
    the op (the tensor keeps its own name everywhere else: errors, the response cache); an unnamed op's
    ``allreduce.noname.<n>`` is that already."""
    prefix = kind.name.lower() + "."
    return name if name.startswith(prefix + "noname.") else prefix + name


def negotiate_phase(kind) -> str:
    """The negotiation phase of a collective: ``NEGOTIATE_ALLREDUCE`` for an allreduce."""
    return "NEGOTIATE_" + kind.name


class Timeline:
    def __init__(self, path: str, rank: int):
        self.path = os.path.abspath(path)
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
        except FileExistsError as exc:  # (a file where a folder of the path should be: "File exists" misled)
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), exc.filename) from None
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        os.write(self._fd, b"[\n")
        self._end_at = 2  # where the closing "]" written by the last flush starts (the next flush writes over it)
        self._first = True  # no event written yet (the next one takes no separating comma)
        self._pending: list = []  # the events since the last flush, encoded
        self._lock = threading.Lock()
        self._tracks: Dict[str, int] = {}
        self._lanes: Dict[str, list] = {}  # track -> the end of the last event on each of its lanes
        self._pid = rank
        self._t0 = time.perf_counter()
        self._closed = False
        self._meta("process_name", 0, {"name": f"aiacc rank {rank}"})
        self._track("cycles")
        self._track("buffers")
        self.flush()  # a valid file from the start, also if the job is killed before its first cycle

    def _us(self, t: float) -> float:
        return round((t - self._t0) * 1e6, 3)

    def _write(self, event: dict) -> None:
        if not self._closed:  # (closed by another thread since the caller looked)
            self._pending.append(json.dumps(event, separators=(",", ":")).encode())

    def _end(self) -> None:
        """The events since the last flush and the closing bracket after them, over the last flush's bracket, in
        one write: the file on disk goes from one complete JSON array to the next (a cycle's events held in a
        buffer that spilled before the bracket, as one of 64 KiB did, left an array without its end there)."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        chunk = (b"" if self._first else b",\n") + b",\n".join(pending)
        self._first = False
        data = chunk + b"\n]\n"
        written = 0
        while written < len(data):
            written += os.pwrite(self._fd, memoryview(data)[written:], self._end_at + written)
        self._end_at += len(chunk)

    def flush(self) -> None:
        """Hand what was written since the last flush to the file, a complete JSON array (the engine calls it
        after each cycle)."""
        if self._pending:
            with self._lock:
                if not self._closed:
                    self._end()

    def instant(self, track: str, name: str, t: float) -> None:
        """One instant event at ``t`` (``time.perf_counter`` seconds)."""
        if self._closed:
            return
        with self._lock:
            self._write({"ph": "i", "s": "t", "name": name, "pid": self._pid, "tid": self._track(track),
                         "ts": self._us(t)})

    def _meta(self, what: str, tid: int, args: dict) -> None:
        self._write({"ph": "M", "name": what, "pid": self._pid, "tid": tid, "args": args})

    def _track(self, name: str) -> int:
        tid = self._tracks.get(name)
        if tid is None:
            tid = self._tracks[name] = len(self._tracks) + 1
            self._meta("thread_name", tid, {"name": name})
            self._meta("thread_sort_index", tid, {"sort_index": tid})
        return tid

    def span_lane(self, track: str, name: str, start: float, end: float, args: Optional[dict] = None) -> None:
        """``span`` on ``track``, or, where it would partly overlap an event there (buffers in flight together),
        on ``track 2``, ``track 3``, ...: the first lane free at ``start``. Events come in the order they end
        (the engine writes one when it is done), so a lane is free once its last event ended."""
        lanes = self._lanes.setdefault(track, [])
        for i, last_end in enumerate(lanes):
            if last_end <= start:
                lanes[i] = end
                break
        else:
            i = len(lanes)
            lanes.append(end)
        self.span(track if i == 0 else f"{track} {i + 1}", name, start, end, args)

    def span(self, track: str, name: str, start: float, end: float, args: Optional[dict] = None) -> None:
        """One complete event from ``start`` to ``end`` (``time.perf_counter`` seconds)."""
        if self._closed:
            return
        start = max(start, self._t0)  # (a tensor queued before start_timeline: from the timeline's start)
        event = {"ph": "X", "name": name, "pid": self._pid, "tid": self._track(track),
                 "ts": self._us(start), "dur": max(0.0, round((end - start) * 1e6, 3))}
        if args:
            event["args"] = args
        with self._lock:
            self._write(event)

    def tensor(self, kind, name: str, phases) -> None:
        """All phases of one tensor of collective ``kind``, on its track (``track_name``): ``phases`` is
        [(phase, start, end), ...], a phase's optional fourth item its args (the collective's own phase
        carries them)."""
        track = track_name(kind, name)
        for phase, start, end, *rest in phases:
            args = rest[0] if rest else None
            if start is not None and end is not None:
                self.span(track, phase, start, end, args)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._write({"ph": "M", "name": "aiacc_end", "pid": self._pid, "tid": 0, "args": {}})
            self._end()
            self._closed = True
            os.close(self._fd)
