"""Horovod's elastic state objects (``hvd.elastic.*State``) and restart-based recovery.

The state API is Horovod's: ``commit()`` keeps a copy of the state, ``restore()`` goes back to the last
copy, ``sync()`` makes every rank hold rank 0's state, and ``run(func)`` runs the training function from
the synchronised state. The framework parts (a model's variables) are the adapters' subclasses of
:class:`ObjectState` (``aiacc.torch.elastic.TorchState``, ...); this module is framework-free.

Recovery is torchrun's (restart the job), not Horovod's in-place resizing: under
``aiaccrun --max-restarts N --elastic-dir DIR`` a rank that dies or raises ends every rank, and the launcher
starts the job again, up to N times. Each ``commit()`` also writes the committed state to DIR (rank 0, on a
background thread: the training loop pays for the in-memory copy only). A commit file is written under a
temporary name, fsynced and renamed, with a checksum of its contents, so a commit still being written when
the job died is simply absent, and a damaged one is skipped (with a warning) for the one before it. On a
restart, ``run`` loads the newest complete commit on rank 0, and ``sync()`` gives it to every rank, so all
resume equal from the last commit. ``restart_count()`` (``AIACC_RESTART_COUNT``) says which start this is.
A directory written by another job (another world size, another state's structure) is refused, never loaded;
under ``aiaccrun --host-discovery-script`` a restart may have another number of ranks, and a commit of any
world size within ``--min-np``..``--max-np`` is accepted (the state must then hold its data position in
global terms: see the README). A ``.tmp`` file a previous job left half-written is removed at the next start.
"""

from __future__ import annotations

import atexit
import copy
import functools
import hashlib
import json
import logging
import os
import pickle
import re
import threading
import weakref
import zlib
from typing import Callable, Iterable, NamedTuple, Optional, Tuple

import cloudpickle
import numpy as np

from .api import rank, size
from .config import from_env
from .objects import broadcast_object

__all__ = ["State", "ObjectState", "run", "restart_count", "CommitStore", "FrameworkPayload", "ElasticStateError",
           "idle_priority"]

logger = logging.getLogger("aiacc")
_MAGIC = b"AIACC-COMMIT-2\n"
_MAGIC_V1 = b"AIACC-COMMIT-1\n"  # still read
_CHUNK = 8 << 20  # bytes checksummed and written at a time (each call releases the GIL)
_ALIGN = 64  # arrays in a commit file start at multiples of this (loaded, they are aligned views)
_CRC_PLACEHOLDER = "--------"  # 8 characters, as the hexadecimal CRC-32 that replaces it
# commit-<seq>.aiacc: a commit of the script's first elastic phase; commit-<seq>.p<k>.aiacc of its phase k
_FILE = re.compile(r"^commit-(\d{8})(?:\.p(\d+))?\.aiacc$")
_PARTIAL = re.compile(r"^commit-(\d{8})(?:\.p(\d+))?\.aiacc\.tmp$")  # being written, or torn by the job's end
KEEP = 3  # complete commits kept in the directory per phase (per state: see ``_phases``)


class ElasticStateError(RuntimeError):
    """An elastic state that cannot be saved, or a commit directory that cannot be used. Unless
    ``restart_would_fail`` is False (a write that failed), a restart would meet it again: uncaught, it ends the
    job without the restarts of ``aiaccrun --max-restarts``."""

    def __init__(self, message: str, restart_would_fail: bool = True):
        super().__init__(message)
        self.restart_would_fail = restart_would_fail


def restart_count() -> int:
    """How many times ``aiaccrun --max-restarts`` has restarted this job (0 on the first start)."""
    return int(os.environ.get("AIACC_RESTART_COUNT", "0") or 0)


class CommitStore:
    """Committed states in ``directory``, one file per commit, written by one thread in the background.

    A file is ``MAGIC``, a JSON header line (sequence number, the job's fingerprint, the lengths of the parts
    and a CRC-32 of everything after the header), the payload pickled with protocol 5 and then, back to back,
    the raw bytes of its numpy arrays (pickle's out-of-band buffers): an array is never copied into a pickle,
    and the writer checksums and writes it in chunks, which release the GIL. It is written as ``.tmp``,
    fsynced and renamed, so only complete files carry the final name. ``write`` hands a payload to the
    writer and returns; a commit that arrives while the previous one is still being written waits for it
    (two commits never interleave). At most :data:`KEEP` complete commits stay. The interpreter's exit waits
    for the commit being written (:func:`_finish_at_exit`), so a ``commit()`` that returned is on disk when a
    script that ended normally has exited, also one made outside ``run`` (the script's last line)."""

    def __init__(self, directory: str, direct_io: bool = True):
        self.directory = directory
        self.direct_io = direct_io  # commit files written with O_DIRECT where the filesystem takes it
        try:  # (it was the bare OSError, "File exists: 'train.py'", and the launcher restarted the job for nothing)
            os.makedirs(directory, exist_ok=True)
            names = os.listdir(directory)
            if not os.access(directory, os.W_OK | os.X_OK):
                raise PermissionError(f"no permission to write in {directory}")
        except OSError as e:
            raise ElasticStateError(f"the elastic directory {directory!r} (aiaccrun --elastic-dir, AIACC_ELASTIC_DIR) "
                                    f"cannot be used: {'it is a file, not a directory' if os.path.isfile(directory) else e}"
                                    ) from None
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._seq = max([int(m.group(1)) for m in map(_FILE.match, names) if m] or [0])
        _stores.add(self)
        _wait_at_exit()

    def write(self, make_payload: Callable[[], object], fingerprint: dict,
              on_done: Optional[Callable[[], None]] = None, phase: int = 0) -> None:
        """Write what ``make_payload()`` returns (called on the writer thread; picklable, its numpy arrays
        written raw) as the next commit of elastic phase ``phase``; ``on_done()`` is called on that thread when
        the write has ended (the payload's arrays are no longer read), whether it succeeded or not."""
        self.flush()
        self._seq += 1
        self._thread = threading.Thread(target=self._write, args=(self._seq, make_payload, fingerprint, on_done,
                                                                   phase),
                                        name="aiacc-commit", daemon=True)
        self._thread.start()

    def flush(self) -> None:
        """Wait until the commit being written is on disk; raise its error, if writing failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise ElasticStateError(f"writing a commit to {self.directory} failed: {error}",
                                    restart_would_fail=False) from error

    def _write(self, seq: int, make_payload, fingerprint: dict, on_done, phase: int = 0) -> None:
        try:
            buffers = []
            body = pickle.dumps(make_payload(), protocol=5, buffer_callback=buffers.append)
            parts = [memoryview(body)] + [b.raw() for b in buffers]
            header = json.dumps({"seq": seq, "fingerprint": fingerprint, "pickle": len(body),
                                 "buffers": [v.nbytes for v in parts[1:]], "crc32": _CRC_PLACEHOLDER},
                                sort_keys=True).encode()
            key = b'"crc32": "'
            crc_at = len(_MAGIC) + header.index(key + _CRC_PLACEHOLDER.encode()) + len(key)  # filled in at the end
            final = os.path.join(self.directory, f"commit-{seq:08d}{f'.p{phase}' if phase else ''}.aiacc")
            tmp = final + ".tmp"
            sink = _open_sink(tmp, self.direct_io, crc_at)
            try:
                sink.write(memoryview(_MAGIC + header + b"\n"))
                crc, at = 0, len(_MAGIC) + len(header) + 1
                for k, part in enumerate(parts):
                    if k > 0 and at % _ALIGN:  # each array starts at a multiple of _ALIGN bytes
                        pad = b"\0" * (_ALIGN - at % _ALIGN)
                        crc = zlib.crc32(pad, crc)
                        sink.write(memoryview(pad))
                        at += len(pad)
                    for start in range(0, part.nbytes, _CHUNK):
                        chunk = part[start:start + _CHUNK]
                        crc = zlib.crc32(chunk, crc)
                        sink.write(chunk)
                    at += part.nbytes
                sink.finish(f"{crc:08x}".encode())  # the checksum into the header; on disk (fsync)
            finally:
                sink.close()
            del parts, buffers
            os.replace(tmp, final)
            dir_fd = os.open(self.directory, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
            for old in self._complete(phase)[KEEP:]:
                os.unlink(os.path.join(self.directory, old))
        except BaseException as exc:  # noqa: BLE001 - reported by the next flush()
            self._error = exc
        finally:
            if on_done is not None:
                on_done()

    def _complete(self, phase: int = 0):
        """Names of the complete commit files of elastic phase ``phase``, newest first."""
        names = [(m.group(1), m.string) for m in map(_FILE.match, os.listdir(self.directory))
                 if m and int(m.group(2) or 0) == phase]
        return [name for _, name in sorted(names, reverse=True)]

    def discard_partial(self) -> list:
        """Remove the commit files a previous job left unfinished (``.tmp``: it ended while one was being
        written; it is never loaded); returns their names. This job's own commit in flight is finished first."""
        self.flush()
        names = sorted(n for n in os.listdir(self.directory) if _PARTIAL.match(n))
        for name in names:
            logger.warning("aiacc elastic: removing %s, a commit the previous job left half-written",
                           os.path.join(self.directory, name))
            os.unlink(os.path.join(self.directory, name))
        return names

    def load_latest(self, fingerprint: dict, world_sizes: Optional[Tuple[int, int]] = None, phase: int = 0):
        """The payload of the newest intact commit of elastic phase ``phase``, unpickled (None when there is
        none). A damaged file is skipped with a warning; a commit of another job is refused with an
        ElasticStateError. With ``world_sizes`` (min, max; an elastic launch, whose restarts may have another
        number of ranks) a commit written at another world size within that range is this job's too."""
        for name in self._complete(phase):
            path = os.path.join(self.directory, name)
            try:
                header, read = _read_commit(path)
            except (OSError, ValueError, KeyError, TypeError) as exc:
                logger.warning("aiacc elastic: skipping damaged commit %s (%s); trying the one before", path, exc)
                continue
            if not _same_job(header["fingerprint"], fingerprint, world_sizes):
                allowed = ("" if world_sizes is None else
                           f" (the world sizes --min-np/--max-np allow: {world_sizes[0]} to "
                           f"{world_sizes[1] if world_sizes[1] < _NO_BOUND else 'any'})")
                raise ElasticStateError(
                    f"elastic directory {self.directory} holds commits of another job: {name} was written for "
                    f"{_describe(header['fingerprint'])}, this job is {_describe(fingerprint)}{allowed}; "
                    "use a new directory")
            return read()
        return None


_NO_BOUND = 1 << 62
# The commit stores of this process, for the interpreter's exit to wait for their writers. (A store whose writer
# runs stays alive: the thread holds it.)
_stores: "weakref.WeakSet[CommitStore]" = weakref.WeakSet()
_exit_hook = False


def _wait_at_exit() -> None:
    """Register :func:`_finish_at_exit` once in this process (when its first store is made: after ``init()``, so
    it runs before aiacc's own shutdown at exit, atexit calls being last-in first-out)."""
    global _exit_hook
    if not _exit_hook:
        _exit_hook = True
        atexit.register(_finish_at_exit)


def _finish_at_exit() -> None:
    """At the interpreter's exit: wait for every commit still being written, and report one that failed.

    The writer is a daemon thread, which CPython ends wherever it is once the exit's atexit calls are done:
    ``run`` waits for it on return, but a script whose last line commits (after ``run`` returned) used to leave
    that commit as a ``.tmp`` file, and the next start resumed from the commit before it. The wait has no time
    limit, as for a non-daemon thread: the file is on disk when the process has exited (Ctrl-C ends the wait,
    and the commit with it). It costs a commit nothing: it is registered once, when the first store is made."""
    for store in list(_stores):
        thread = store._thread
        if thread is not None and thread.is_alive():
            logger.info("aiacc elastic: waiting for the last commit to be written to %s", store.directory)
        try:
            store.flush()
        except Exception as exc:  # noqa: BLE001 - the interpreter is exiting: said, not raised
            logger.error("aiacc elastic: the last commit was lost: %s", exc)


def idle_priority() -> None:
    """Run the calling thread only on a core nothing else wants (Linux ``SCHED_IDLE``; elsewhere, or where it
    is refused, the lowest nice value it may take, else nothing): a commit's copy and write are background
    work, and at normal priority a copy thread delayed the training thread's wake-ups on a machine whose cores
    it shares (measured: +8 ms of forward per 100 MB commit in the ResNet-50 replay). A training step that
    waits for such a thread leaves its core idle, so the thread then runs at once."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: this thread (Linux: per thread)
        return
    except (AttributeError, OSError):
        pass
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):
        pass


_BLOCK = 4096  # what direct I/O writes at a time: offsets, lengths and memory aligned to it


class _BufferedSink:
    """A commit file written through the page cache (where direct I/O is refused)."""

    def __init__(self, path: str, patch_at: int):
        self._f = open(path, "wb")
        self._patch_at = patch_at

    def write(self, data: memoryview) -> None:
        self._f.write(data)

    def finish(self, patch: bytes) -> None:
        """Write ``patch`` at the offset given at the start (within what was written); put the file on disk."""
        f = self._f
        f.seek(self._patch_at)
        f.write(patch)
        f.flush()
        os.fsync(f.fileno())

    def close(self) -> None:
        self._f.close()


class _DirectSink:
    """A commit file written with ``O_DIRECT``: from an aligned staging buffer straight to the disk, not
    through the page cache. Measured here (ext4, 100 MB): buffered writing took ~20 ms of CPU plus ~7 ms in
    ``fsync``; direct writing ~2 ms plus the copy into the staging buffer (~6 ms) — CPU a training loop
    shares on a machine whose cores all compute. The file's bytes are the same either way: the last block
    is written whole and the file then cut to its length, and the blocks that hold ``patch_at`` (the header's
    checksum, known only at the end) are kept when they go out, to be written again patched. ``OSError``
    where the filesystem refuses direct I/O (found by writing a first block, which later writes replace)."""

    def __init__(self, path: str, patch_at: int):
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        raw = np.zeros(_CHUNK + _BLOCK, dtype=np.uint8)
        skip = (-raw.ctypes.data) % _BLOCK
        self._stage = raw[skip:skip + _CHUNK]
        try:
            os.pwrite(self._fd, memoryview(self._stage[:_BLOCK]), 0)
        except OSError:
            os.close(self._fd)
            raise
        self._fill = 0  # bytes in the staging buffer
        self._written = 0  # bytes on disk
        self._patch_at = patch_at
        self._kept: Optional[Tuple[int, bytes]] = None  # (offset, bytes) of the blocks that hold patch_at

    def write(self, data: memoryview) -> None:
        data = np.frombuffer(data, dtype=np.uint8)
        pos, n = 0, data.size
        while pos < n:
            take = min(_CHUNK - self._fill, n - pos)
            self._stage[self._fill:self._fill + take] = data[pos:pos + take]
            self._fill += take
            pos += take
            if self._fill == _CHUNK:
                self._flush(_CHUNK)

    def _flush(self, length: int) -> None:
        start = self._written
        if self._kept is None and start <= self._patch_at < start + length:
            first = (self._patch_at - start) // _BLOCK * _BLOCK
            self._kept = (start + first, bytes(self._stage[first:min(length, first + 2 * _BLOCK)]))
        view = memoryview(self._stage[:length])
        done = 0
        while done < length:
            done += os.pwrite(self._fd, view[done:], start + done)
        self._written += length
        self._fill = 0

    def finish(self, patch: bytes) -> None:
        end = self._written + self._fill
        if self._fill:
            whole = -(-self._fill // _BLOCK) * _BLOCK
            self._stage[self._fill:whole] = 0
            self._flush(whole)
        if self._kept is None or self._patch_at + len(patch) > self._kept[0] + len(self._kept[1]):
            raise ValueError(f"the commit's checksum at byte {self._patch_at} is not in what was written")
        offset, kept = self._kept
        blocks = bytearray(kept)
        at = self._patch_at - offset
        blocks[at:at + len(patch)] = patch
        self._stage[:len(blocks)] = np.frombuffer(bytes(blocks), dtype=np.uint8)
        os.pwrite(self._fd, memoryview(self._stage[:len(blocks)]), offset)
        os.ftruncate(self._fd, end)
        os.fsync(self._fd)

    def close(self) -> None:
        os.close(self._fd)


def _open_sink(path: str, direct: bool, patch_at: int):
    """A direct-I/O writer of ``path`` (``direct``, where the filesystem takes it), else a buffered one; either
    writes ``finish(patch)`` at ``patch_at`` at the end."""
    if direct and hasattr(os, "O_DIRECT"):
        try:
            return _DirectSink(path, patch_at)
        except OSError:
            pass
    return _BufferedSink(path, patch_at)


def _read_commit(path: str):
    """(header, a function returning the payload) of a commit file whose checksum matches; ValueError if
    it is damaged. The payload's arrays are views of the file's bytes (read once, writable)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        memory = np.empty(size + _ALIGN, dtype=np.uint8)  # the file's start at an _ALIGN-byte boundary
        skip = (-memory.ctypes.data) % _ALIGN
        view = memoryview(memory[skip:skip + size]).cast("B")
        if f.readinto(view) != size:
            raise ValueError("it changed while it was read")
    first = bytes(view[:4096])
    if first.startswith(_MAGIC_V1):  # written by aiacc before out-of-band buffers: sha256 of one pickle
        head_end = _line_end(view, len(_MAGIC_V1))
        header, payload = json.loads(view[len(_MAGIC_V1):head_end].tobytes()), view[head_end + 1:]
        if len(payload) != header["length"] or hashlib.sha256(payload).hexdigest() != header["sha256"]:
            raise ValueError("its contents do not match their checksum")
        return header, lambda: pickle.loads(payload)
    if not first.startswith(_MAGIC):
        raise ValueError("not an aiacc commit file")
    head_end = _line_end(view, len(_MAGIC))
    header = json.loads(view[len(_MAGIC):head_end].tobytes())
    start = head_end + 1
    pieces, at = [], start
    for k, length in enumerate([int(header["pickle"]), *map(int, header["buffers"])]):
        at += (-at) % _ALIGN if k > 0 else 0
        pieces.append((at, length))
        at += length
    if at != size:
        raise ValueError(f"it holds {size} bytes, its header describes {at}")
    crc = 0
    for offset in range(start, size, _CHUNK):
        crc = zlib.crc32(view[offset:offset + _CHUNK], crc)
    if f"{crc:08x}" != header["crc32"]:
        raise ValueError("its contents do not match their checksum")
    pieces = [view[offset:offset + length] for offset, length in pieces]
    return header, lambda: pickle.loads(pieces[0], buffers=pieces[1:])


def _line_end(view: memoryview, start: int) -> int:
    """The index of the newline that ends the header line beginning at ``start``."""
    end = bytes(view[start:start + (1 << 24)]).find(b"\n")
    if end < 0:
        raise ValueError("its header line has no end")
    return start + end


def _same_job(written: dict, ours: dict, world_sizes: Optional[Tuple[int, int]]) -> bool:
    if world_sizes is not None and world_sizes[0] <= written.get("world_size", -1) <= world_sizes[1]:
        written = dict(written, world_size=ours.get("world_size"))
    return written == ours


def _describe(fingerprint: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(fingerprint.items()))


class FrameworkPayload(NamedTuple):
    """The framework parts of a commit: ``make()`` returns them on the writer's thread; ``release()`` (if
    any) is called there once the commit file no longer reads them (their buffers may then be reused)."""

    make: Callable[[], dict]
    release: Optional[Callable[[], None]] = None


_store: Optional[CommitStore] = None
# Elastic phases numbered so far in this process. A state's phase is numbered when it is first given to a ``run``
# function (or first committed to the directory, before that): a script of several phases (pretraining, then
# fine-tuning, each ``run`` with a state of its own) keeps each phase's commits apart, and a restarted job replays
# the phases in order, each from its own last commit. (Each ``run`` call was a phase: a script that calls its ``run``
# function once per epoch over one state filed each epoch's commits apart, and a restart replayed every earlier epoch
# from its own last commit, and kept 3 files per epoch. Numbered as states are made, a state made on the first start
# only, for a check, shifted the others' numbers on a restart, which then found no commit of its own.)
_phases = 0


def _world_sizes(config) -> Optional[Tuple[int, int]]:
    """The world sizes a commit may come from: under ``aiaccrun --host-discovery-script`` a restart may have
    another number of ranks, within ``AIACC_MIN_NP``..``AIACC_MAX_NP`` (aiaccrun sets them); else None."""
    if not config.host_discovery_script:
        return None
    return (config.min_np or 1, config.max_np or _NO_BOUND)


def _commit_store() -> Optional[CommitStore]:
    """The job's commit directory (``AIACC_ELASTIC_DIR``), None without one."""
    global _store
    config = from_env()
    directory = config.elastic_dir
    if not directory:
        return None
    if _store is None or _store.directory != directory:
        _store = CommitStore(directory, config.commit_direct_io)
    return _store


class State:
    """State kept in memory across ranks. ``bcast_object(obj)`` sends rank 0's object to every rank;
    ``get_rank()`` returns this rank."""

    def __init__(self, bcast_object: Callable = broadcast_object, get_rank: Callable = rank):
        self._bcast_object = bcast_object
        self._rank = get_rank
        self._reset_callbacks = []
        self._phase: Optional[int] = None  # (see ``_phases``)
        self._resumed = False  # (a ``run`` call loaded its newest commit in this process: later ones go on from it)

    def _elastic_phase(self) -> int:
        global _phases
        if self._phase is None:
            self._phase, _phases = _phases, _phases + 1
        return self._phase

    def register_reset_callbacks(self, callbacks: Iterable[Callable]) -> None:
        """Functions to call after a reset (in Horovod: when ranks were added or removed). In aiacc a reset
        is a restart by ``aiaccrun --max-restarts`` (on the hosts discovered then), or a new job that resumes
        the commit of an earlier one: ``run`` calls them on every rank of the new start, after the commit is
        loaded and before ``sync()``."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Keep the current state in memory (``restore()`` returns to it); with an elastic directory, rank 0
        also writes it there in the background (every rank checks first that it can be saved)."""
        self.save()
        store = _commit_store()
        if store is not None:
            objects = self._objects_bytes()  # every rank: an attribute that cannot be saved is an error everywhere
            if self._rank() == 0:
                framework = self._framework_payload()
                if not isinstance(framework, FrameworkPayload):
                    framework = FrameworkPayload(framework)
                try:
                    store.write(lambda: {"objects": objects, **framework.make()}, self.fingerprint(),
                                on_done=framework.release, phase=self._elastic_phase())
                except BaseException:
                    if framework.release is not None:  # no writer started: nothing reads the payload
                        framework.release()
                    raise
        self.check_host_updates()

    def fingerprint(self) -> dict:
        """What identifies the job a commit belongs to: the world size and the state's structure."""
        return {"world_size": size(), "state": type(self).__name__, "layout": self._layout()}

    def _layout(self) -> str:
        return ""

    def _objects_bytes(self) -> bytes:
        """The keyword attributes as ``save()`` kept them, pickled now (they may change in place after the
        commit) with cloudpickle, as ``broadcast_object`` sends them (closures and lambdas too, as in
        Horovod); an error naming an attribute that cannot be pickled."""
        objects = self._saved_objects()
        for name, value in objects.items():
            try:
                cloudpickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as exc:  # noqa: BLE001 - named below
                raise ElasticStateError(f"elastic state attribute {name!r} cannot be saved: "
                                        f"{type(exc).__name__}: {exc}") from exc
        return cloudpickle.dumps(objects, protocol=pickle.HIGHEST_PROTOCOL)

    def _saved_objects(self) -> dict:
        return {}

    def _framework_payload(self):
        """A function, called on the commit writer's thread, returning the framework parts of this commit
        (what ``save()`` copied; it may still be copying), or a :class:`FrameworkPayload`. Numpy arrays in
        it are written raw (no copy into the pickle)."""
        return dict

    def _load_persisted(self, payload: dict) -> None:
        raise NotImplementedError()

    def check_host_updates(self) -> None:
        """Horovod raises ``HostsUpdatedInterrupt`` here when hosts joined or left: an aiacc job keeps its
        ranks, so there is never anything to report."""

    def save(self) -> None:
        raise NotImplementedError()

    def restore(self) -> None:
        raise NotImplementedError()

    def sync(self) -> None:
        raise NotImplementedError()

    def reset(self) -> None:
        """Called before synchronising after a reset (a restart of the job, see ``register_reset_callbacks``)."""


def _copy(value):
    """A deep copy of an elastic state's attribute, so that changes made in place after a commit (a list appended
    to) neither reach the commit nor survive ``restore()``; an object ``copy.deepcopy`` refuses (a lock) is kept as
    it is, as Horovod keeps every attribute."""
    try:
        return copy.deepcopy(value)
    except Exception:  # noqa: BLE001 - whatever deepcopy raises: such an object cannot be copied, only kept
        return value


class ObjectState(State):
    """State made of picklable Python objects, given as keyword arguments and exposed as attributes
    (``state.epoch``, ``state.batch``): ``save`` copies the attributes (deep copies: a list changed in place
    after a commit is back as committed after ``restore``, as a commit written to the elastic directory has it),
    ``restore`` sets copies of them back, ``sync`` sets rank 0's values on every rank."""

    def __init__(self, bcast_object: Callable = broadcast_object, get_rank: Callable = rank, **kwargs):
        for attr, value in kwargs.items():  # (the objects given, as in Horovod; the saved state holds copies)
            setattr(self, attr, value)
        self._saved_state = {attr: _copy(value) for attr, value in kwargs.items()}
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)

    def save(self) -> None:
        self._saved_state = {attr: _copy(getattr(self, attr)) for attr in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            self._objects_bytes()  # an attribute that cannot be sent is named (on every rank), not pickle's error
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def _set_attrs(self) -> None:
        for attr, value in self._saved_state.items():
            setattr(self, attr, _copy(value))  # (the saved state stays as committed, whatever the attributes do)

    def _saved_objects(self) -> dict:
        return dict(self._saved_state)

    def _load_persisted(self, payload: dict) -> None:
        self._saved_state = dict(pickle.loads(payload["objects"]))
        self.restore()

    def _layout(self) -> str:
        return ",".join(sorted(self._saved_state))


def run(func: Callable) -> Callable:
    """Horovod's ``@hvd.elastic.run``: ``func(state, ...)`` starts from rank 0's state (``state.sync()``).

    Under ``aiaccrun --max-restarts N --elastic-dir DIR``, a restarted job first loads the newest complete
    commit of DIR on rank 0 (``restore()`` of it), so every rank resumes from the last commit. Within one
    start the ranks never change: ``func`` runs once and its errors end the job (which the launcher may
    start again). A restarted start, or a new job that resumes an earlier one's commit, calls
    ``state.on_reset()`` (reset callbacks) before the sync."""

    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        store = _commit_store()
        first = not state._resumed  # (a later call with the same state, one per epoch say, goes on from memory)
        state._resumed, phase = True, state._elastic_phase()
        loaded = False
        if first and store is not None and state._rank() == 0:
            store.discard_partial()
            payload = store.load_latest(state.fingerprint(), _world_sizes(from_env()), phase)
            if payload is not None:
                state._load_persisted(payload)
                loaded = True
                logger.warning("aiacc elastic: start %d resumes from the last commit in %s (%d rank%s)",
                               restart_count(), store.directory, size(), "" if size() == 1 else "s")
        if first and store is not None and restart_count() == 0:
            # a new job (start 0) on the elastic directory of an earlier one, say requeued on fewer hosts, that
            # resumes its commit is a reset too: every rank learns it from rank 0 (they skipped the callbacks)
            loaded = state._bcast_object(loaded)
        if first and (restart_count() > 0 or loaded):
            # a restarted or resuming job is Horovod's reset (ranks were lost, added or removed): reset() and the
            # reset callbacks (say, the learning rate scaled to the new size()) run on every rank, after rank 0
            # loaded the commit and before sync() hands rank 0's state to the others, as in Horovod
            state.on_reset()
        state.sync()
        try:
            return func(state, *args, **kwargs)
        finally:
            if store is not None:
                store.flush()  # the last commit is on disk before the process ends

    return wrapper
