#!/usr/bin/env python3
"""Run Horovod's own test suites against aiacc: the yardstick of its Horovod compatibility.

    python tools/horovod_suites.py --horovod /path/to/horovod torch mxnet1 --np 2 --json out.json

Each suite (``torch``, ``tensorflow``, ``keras``, ``mxnet1``, ``mxnet2``, the short names of ``SUITES``,
or a path such as ``test/parallel/test_torch.py`` inside the Horovod repository) runs as one
``aiaccrun -np N`` job in which every rank runs pytest on the file (a ``test/single`` file on one rank,
as Horovod's CI runs them). Horovod's code is read at run time, never kept: its
``test/`` helpers are copied into a temporary directory, from a checkout or from a git directory
(bare or not: ``git archive``). Beside them, first on ``PYTHONPATH``, an alias package ``horovod``
maps ``horovod.torch`` to ``aiacc.torch`` (the same module object), ``horovod.tensorflow`` to
``aiacc.tensorflow``, ``horovod.keras`` and ``horovod.tensorflow.keras`` to ``aiacc.keras``,
``horovod.mxnet`` to ``aiacc.mxnet`` (see ``AliasFinder``).

A test passes only when no rank fails it. Each rank records its results as JSON lines (a small
pytest plugin, ``RankRecorder``); this process watches them. A test that has not finished on some
rank after ``--test-timeout`` seconds is recorded as ``hang``, a job that ends while a test runs
records that test as ``abort``; either way the job is killed and started again with the tests no
rank has finished, so one hang costs only its own test. ``--suite-timeout`` bounds a whole suite:
tests not reached by then are ``not run``.

Output: a table of passed / failed / skipped / hang-or-abort per suite and every failing test with
the first line of its error (``--json`` for all of it). Exit status 0 when nothing failed, 1 when
some test failed, hung or aborted, 2 when a suite could not run at all (bad arguments, a file that
does not import, a job that never started).

The same file runs on the ranks (``rank_main``, the plugin, the alias finder): the runner copies it
into the temporary directory, so nothing of it needs installing.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import faulthandler
import importlib
import importlib.abc
import importlib.util
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import pytest

# Short names of the suites this tool was written for; any other test file inside the Horovod
# repository can be given by its path.
SUITES = {
    "torch": "test/parallel/test_torch.py",
    "tensorflow": "test/parallel/test_tensorflow.py",
    "keras": "test/parallel/test_tensorflow2_keras.py",
    "mxnet1": "test/parallel/test_mxnet1.py",
    "mxnet2": "test/parallel/test_mxnet2.py",
    "tf_process_sets": "test/parallel/test_tensorflow_process_sets.py",
    "tf_process_sets_dynamic": "test/parallel/test_tensorflow_process_sets_dynamic.py",
    "keras_process_sets": "test/parallel/test_tensorflow2_keras_process_sets.py",
    "process_sets_static": "test/parallel/test_process_sets_static.py",
    "process_sets_multi_comm": "test/parallel/test_process_sets_multi_comm.py",
    "adasum_torch": "test/parallel/test_adasum_pytorch.py",
    "adasum_tf": "test/parallel/test_adasum_tensorflow.py",
    "timeline": "test/parallel/test_timeline.py",
    "torch_elastic": "test/single/test_torch_elastic.py",
}

# What of Horovod's repository the suites import besides themselves: the other files of
# test/parallel (base_test_*.py), test/utils (common.py) and test/conftest.py (puts utils on sys.path);
# and of test/single the one file that tests the frameworks' API (the rest test horovodrun, Ray, Spark).
SUPPORT_PATHS = ("test/parallel", "test/utils", "test/conftest.py", "test/common.py",
                 "test/single/test_torch_elastic.py")


def ranks_of(test_file: str, np_: int) -> int:
    """The ranks a test file runs on: ``--np``, except Horovod's ``test/single`` files, which its CI runs in
    one process (their assertions count on one rank)."""
    return 1 if test_file.startswith("test/single/") else np_

# Horovod package -> aiacc module; a submodule maps to the same submodule of aiacc.
ALIASES = {
    "horovod.torch": "aiacc.torch",
    "horovod.tensorflow": "aiacc.tensorflow",
    "horovod.keras": "aiacc.keras",
    "horovod.mxnet": "aiacc.mxnet",
}

# Result kinds, in the order the table shows them.
PASSED, FAILED, SKIPPED, HANG, ABORT, NOT_RUN = "passed", "failed", "skipped", "hang", "abort", "not run"
OUTCOMES = (PASSED, FAILED, SKIPPED, HANG, ABORT, NOT_RUN)

MODULE_NAME = "horovod_suites"  # the name this file has on the ranks
ALIAS_INIT = '''"""Not Horovod: an alias made by aiacc's tools/horovod_suites.py; horovod.<framework> is aiacc.<framework>."""
import horovod_suites as _suites

_suites.install_alias()
'''


# ---------------------------------------------------------------------------------------------
# The alias package (runs on the ranks)
# ---------------------------------------------------------------------------------------------

def _is_version_greater_equal_than(ver: str, target: str) -> bool:
    """Horovod's ``horovod.common.util.is_version_greater_equal_than``: a version comparison."""
    from packaging import version  # noqa: PLC0415

    if not isinstance(ver, str) or not isinstance(target, str):
        raise ValueError("This function only accepts string arguments.")
    if len(target.split(".")) != 3:
        raise ValueError("We only accepts target version values in the form of: major.minor.patch. "
                         f"Received: {target}")
    return version.parse(ver) >= version.parse(target)


@contextlib.contextmanager
def _env(**variables):
    """Horovod's ``horovod.common.util.env``: set environment variables for the block, then restore them."""
    saved = {k: os.environ.get(k) for k in variables}
    os.environ.update({k: str(v) for k, v in variables.items()})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _get_env_rank_and_size():
    """Horovod's ``horovod.runner.common.util.env.get_env_rank_and_size``: this process's rank and the job's
    size as its launcher's variables give them (0, 1 without any)."""
    for rank_var, size_var in (("HOROVOD_RANK", "HOROVOD_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
                               ("PMI_RANK", "PMI_SIZE")):
        rank, size = os.environ.get(rank_var), os.environ.get(size_var)
        if rank is not None and size is not None:
            return int(rank), int(size)
        if rank is not None or size is not None:
            raise RuntimeError(f"only one of {rank_var} and {size_var} is set")
    return 0, 1


def _in_thread(target, args=(), name=None, daemon=True, silent=False) -> threading.Thread:
    """Horovod's ``horovod.runner.util.threads.in_thread``: run ``target`` in a started thread."""
    if not isinstance(args, tuple):
        args = (args,)

    def run(*a):
        try:
            target(*a)
        except BaseException:  # noqa: BLE001 - silent=True is the helper's contract
            if not silent:
                raise

    thread = threading.Thread(target=run, args=args, name=name, daemon=daemon)
    thread.start()
    return thread


def _executing_eagerly() -> bool:
    """Horovod's ``horovod.tensorflow.util._executing_eagerly``: TensorFlow's mode, not aiacc's."""
    import tensorflow as tf  # noqa: PLC0415

    return tf.executing_eagerly()


# Helpers of Horovod's *test harness* that the suites import at module level: without them no test
# of a suite could even be collected. They compare versions, set environment variables for a block, read
# the rank and size the launcher set, start a thread and report TensorFlow's execution mode; none of them stands in for anything aiacc is tested on. Any other attribute of
# these modules is an AttributeError that says so.
HARNESS_SHIMS: Dict[str, Dict[str, object]] = {
    "horovod.common": {},
    "horovod.common.util": {"is_version_greater_equal_than": _is_version_greater_equal_than, "env": _env},
    "horovod.runner": {},
    "horovod.runner.util": {},
    "horovod.runner.common": {},
    "horovod.runner.common.util": {},
    "horovod.runner.common.util.env": {"get_env_rank_and_size": _get_env_rank_and_size},
    "horovod.runner.util.threads": {"in_thread": _in_thread},
    "horovod.tensorflow.util": {"_executing_eagerly": _executing_eagerly},
}


def alias_target(fullname: str) -> Optional[str]:
    """The aiacc module that ``fullname`` (horovod.<...>) stands for, or None if there is none."""
    for prefix, target in ALIASES.items():
        if fullname == prefix or fullname.startswith(prefix + "."):
            return target + fullname[len(prefix):]
    return None


class _AliasLoader(importlib.abc.Loader):
    """Puts the aiacc module itself in ``sys.modules`` under the Horovod name (no wrapper)."""

    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec):
        return None  # a placeholder; exec_module replaces it in sys.modules

    def exec_module(self, module):
        fullname = module.__spec__.name
        try:
            real = importlib.import_module(self.target)
        except ModuleNotFoundError as exc:
            if exc.name and (self.target == exc.name or self.target.startswith(exc.name + ".")):
                raise ModuleNotFoundError(
                    f"No module named {fullname!r}: aiacc has no {self.target!r} "
                    "(alias of tools/horovod_suites.py)", name=fullname) from None
            raise
        # The import system returns whatever sys.modules holds once exec_module is done.
        sys.modules[fullname] = real


class _ShimLoader(importlib.abc.Loader):
    def __init__(self, attrs: Dict[str, object]):
        self.attrs = attrs

    def exec_module(self, module):
        name = module.__spec__.name
        module.__path__ = []  # a package, so that horovod.common.util can be imported below horovod.common
        module.__dict__.update(self.attrs)

        def __getattr__(attr):
            if attr.startswith("__"):
                raise AttributeError(attr)
            raise AttributeError(f"{name}.{attr}: not provided; the alias of tools/horovod_suites.py only "
                                 f"has the test-harness helpers {sorted(self.attrs) or 'none'} here")

        module.__getattr__ = __getattr__


class AliasFinder(importlib.abc.MetaPathFinder):
    """Resolves every ``horovod.*`` import: an aiacc module, a harness helper, or a clear error."""

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith("horovod."):
            return None
        if fullname in HARNESS_SHIMS:
            return importlib.util.spec_from_loader(fullname, _ShimLoader(HARNESS_SHIMS[fullname]), is_package=True)
        aiacc_name = alias_target(fullname)
        if aiacc_name is None:
            raise ModuleNotFoundError(
                f"No module named {fullname!r}: the alias of tools/horovod_suites.py maps only "
                f"{', '.join(sorted(ALIASES))} (to aiacc) and the harness helpers {', '.join(sorted(HARNESS_SHIMS))}",
                name=fullname)
        return importlib.util.spec_from_loader(fullname, _AliasLoader(aiacc_name))


def install_alias() -> None:
    """Called by the alias package's ``__init__``: puts the finder first on ``sys.meta_path``, once."""
    if not any(isinstance(f, AliasFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, AliasFinder())


# ---------------------------------------------------------------------------------------------
# The rank side: pytest with a recorder plugin
# ---------------------------------------------------------------------------------------------

RANK_ENV_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "MPI_LOCALRANKID")


def rank_from_env(environ=os.environ) -> int:
    for var in RANK_ENV_VARS:
        if environ.get(var, "").isdigit():
            return int(environ[var])
    raise RuntimeError(f"no MPI rank in the environment (looked at {', '.join(RANK_ENV_VARS)})")


def _first_line(text: str) -> str:
    for line in str(text).splitlines():
        if line.strip():
            return line.strip()
    return ""


class RankRecorder:
    """pytest plugin: appends one JSON line per event to this rank's results file, flushed at once.

    Events: ``session`` (pid), ``collected`` (node ids in run order), ``collect-error``, ``start``
    and ``end`` of each test (outcome, first line of the error, the error's last lines), ``finished``.
    """

    def __init__(self, path: Path, selection: Optional[List[str]]):
        self.out = open(path, "a", buffering=1)
        self.selection = selection
        self.reports: Dict[str, list] = {}
        self._write(event="session", pid=os.getpid())

    def _write(self, **record) -> None:
        record["time"] = time.time()
        self.out.write(json.dumps(record) + "\n")
        self.out.flush()

    @pytest.hookimpl(trylast=True)  # after -k and -m have deselected what they deselect
    def pytest_collection_modifyitems(self, session, config, items):
        if self.selection is not None:
            wanted = set(self.selection)
            deselected = [i for i in items if i.nodeid not in wanted]
            items[:] = [i for i in items if i.nodeid in wanted]
            if deselected:
                config.hook.pytest_deselected(items=deselected)
        self._write(event="collected", tests=[i.nodeid for i in items])

    def pytest_collectreport(self, report):
        if report.failed:
            self._write(event="collect-error", nodeid=report.nodeid, message=_error_line(report),
                        detail=_detail(report))

    def pytest_runtest_logstart(self, nodeid, location):
        self.reports[nodeid] = []
        self._write(event="start", nodeid=nodeid)

    def pytest_runtest_logreport(self, report):
        self.reports.setdefault(report.nodeid, []).append(report)

    def pytest_runtest_logfinish(self, nodeid, location):
        outcome, message, detail = rank_outcome(self.reports.pop(nodeid, []))
        self._write(event="end", nodeid=nodeid, outcome=outcome, message=message, detail=detail)

    def pytest_sessionfinish(self, session, exitstatus):
        self._write(event="finished", exitstatus=int(exitstatus))


def _error_line(report) -> str:
    """The first line of a failure's error; after a header line (TensorFlow's "Graph execution error:",
    Keras' "in user code:") also the exception further down that it announces."""
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None and getattr(crash, "message", None):
        lines = [ln.strip() for ln in crash.message.splitlines() if ln.strip()]
        first = lines[0] if lines else ""
        if first.endswith(":"):
            cause = next((ln for ln in reversed(lines[1:]) if re.match(r"^[\w.]*(Error|Exception)\b", ln)), "")
            first = f"{first} {cause}".strip()
        return first
    text = str(report.longrepr) if report.longrepr is not None else ""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("E ")]
    return (errors[0][1:].strip() if errors else (lines[-1].strip() if lines else ""))


def _detail(report, keep: int = 40) -> str:
    text = str(report.longrepr) if report.longrepr is not None else ""
    return "\n".join(text.splitlines()[-keep:])


def rank_outcome(reports) -> Tuple[str, str, str]:
    """(outcome, first line of the error or skip reason, last lines of the error) of one test on one rank."""
    for rep in reports:
        if rep.failed:
            where = "" if rep.when == "call" else f"error in {rep.when}: "
            return FAILED, where + _error_line(rep), _detail(rep)
    for rep in reports:
        if rep.skipped:
            if hasattr(rep, "wasxfail"):
                return SKIPPED, f"xfail: {rep.wasxfail}", ""
            reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else _error_line(rep)
            return SKIPPED, _first_line(reason), ""
    return PASSED, "", ""


def rank_main(argv: Optional[Sequence[str]] = None) -> int:
    """One rank: its output into its own log, then pytest with the recorder."""
    p = argparse.ArgumentParser(prog="horovod_suites rank")
    p.add_argument("--results", required=True, type=Path)
    p.add_argument("--selection", type=Path)
    p.add_argument("--preimport", action="append", default=[])
    p.add_argument("pytest_args", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    rank = rank_from_env()
    log = open(args.results / f"rank{rank}.log", "ab", buffering=0)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    # Before it kills a hung job the runner sends SIGUSR1: every thread's stack goes into the log,
    # through the log's own descriptor (pytest points 1 and 2 at its capture files during a test).
    faulthandler.register(signal.SIGUSR1, file=log, all_threads=True)
    selection = json.loads(args.selection.read_text()) if args.selection else None
    recorder = RankRecorder(args.results / f"rank{rank}.jsonl", selection)
    for name in args.preimport:
        importlib.import_module(name)
    pytest_args = args.pytest_args[1:] if args.pytest_args[:1] == ["--"] else args.pytest_args
    return int(pytest.main(pytest_args, plugins=[recorder]))


# ---------------------------------------------------------------------------------------------
# The runner
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass
class TestResult:
    nodeid: str
    outcome: str
    message: str = ""
    ranks: Dict[int, str] = dataclasses.field(default_factory=dict)  # rank -> its outcome
    seconds: float = 0.0
    detail: str = ""


@dataclasses.dataclass
class SuiteReport:
    suite: str
    file: str
    np: int
    source: str
    tests: List[TestResult] = dataclasses.field(default_factory=list)
    errors: List[str] = dataclasses.field(default_factory=list)
    jobs: int = 0
    seconds: float = 0.0

    def counts(self) -> Dict[str, int]:
        counts = {o: 0 for o in OUTCOMES}
        for t in self.tests:
            counts[t.outcome] += 1
        return counts

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["counts"] = self.counts()
        return d


@dataclasses.dataclass
class RankTest:
    start: float
    end: Optional[float] = None
    outcome: str = ""
    message: str = ""
    detail: str = ""


class RankState:
    """What one rank's results file says so far."""

    def __init__(self, path: Path):
        self.path = path
        self._reset()

    def _reset(self) -> None:
        self.pid: Optional[int] = None
        self.collected: Optional[List[str]] = None
        self.collect_errors: List[str] = []
        self.tests: Dict[str, RankTest] = {}
        self.current: Optional[str] = None
        self.last_event = 0.0
        self.finished = False

    def refresh(self) -> None:
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return
        self._reset()
        for line in text.splitlines(keepends=True):
            if not line.endswith("\n"):
                break  # still being written
            rec = json.loads(line)
            self.last_event = rec["time"]
            ev = rec["event"]
            if ev == "session":
                self.pid = rec["pid"]
            elif ev == "collected":
                self.collected = rec["tests"]
            elif ev == "collect-error":
                self.collect_errors.append(f"{rec['nodeid'] or 'collection'}: {rec['message']}")
            elif ev == "start":
                self.tests[rec["nodeid"]] = RankTest(start=rec["time"])
                self.current = rec["nodeid"]
            elif ev == "end":
                t = self.tests.setdefault(rec["nodeid"], RankTest(start=rec["time"]))
                t.end, t.outcome, t.message, t.detail = rec["time"], rec["outcome"], rec["message"], rec["detail"]
                self.current = None
            elif ev == "finished":
                self.finished = True

    def ended(self, nodeid: str) -> bool:
        t = self.tests.get(nodeid)
        return t is not None and t.end is not None


@dataclasses.dataclass
class JobEnd:
    reason: str  # exited | hang | startup-timeout | suite-timeout | exit-timeout
    status: Optional[int]
    ranks: List[RankState]


def merge(nodeid: str, ranks: List[RankState]) -> TestResult:
    """One test that every rank finished: passed only if no rank failed it."""
    per = {r: st.tests[nodeid] for r, st in enumerate(ranks)}
    result = TestResult(nodeid, PASSED, ranks={r: t.outcome for r, t in per.items()},
                        seconds=round(max(t.end - t.start for t in per.values()), 3))
    failed = [r for r, t in per.items() if t.outcome == FAILED]
    skipped = [r for r, t in per.items() if t.outcome == SKIPPED]
    if failed:
        result.outcome = FAILED
        result.message = f"rank {failed[0]}: {per[failed[0]].message}"
        result.detail = per[failed[0]].detail
    elif skipped:
        result.outcome = SKIPPED
        result.message = per[skipped[0]].message
    return result


def _is_rank_of(pid: int, job_dir: Path) -> bool:
    """Whether ``pid`` is still a rank of the job writing to ``job_dir`` (its command line names it).

    hydra's proxies start the ranks in sessions of their own, so the job's process group does not
    reach them; a pid alone could by now belong to someone else's process, its command line cannot.
    """
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"\0" + os.fsencode(str(job_dir)) + b"\0" in cmdline


def _log_tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return ""
    return "\n".join(ln for ln in text.splitlines()[-lines:])


def _stall_report(path: Path, nodeid: str) -> str:
    """The first tensor of aiacc's last stall warning printed since ``nodeid`` began, if any."""
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return ""
    text = text[max(text.rfind(nodeid), 0):]
    at = text.rfind("aiacc stall:")
    if at < 0:
        return ""
    lines = [ln.strip() for ln in text[at:].splitlines()[1:]]
    tensors = [ln for ln in lines if ln.startswith("tensor ") or ln.startswith("... and")]
    return "; ".join(tensors[:2])


def _without_harness_frames(text: str) -> str:
    """A stack dump without the frames of pytest, pluggy and this runner (the same in every dump)."""
    noise = ("/_pytest/", "/pluggy/", f"/{MODULE_NAME}.py", 'File "<string>"')
    return "\n".join(ln for ln in text.splitlines() if not any(n in ln for n in noise))


def _last_line(path: Path) -> str:
    """The line of a rank's log that best says why it ended: a fatal error or exception, else its last line."""
    tail = [ln.strip() for ln in _log_tail(path, 400).splitlines() if ln.strip()]
    tail = [ln for ln in tail if not ln.startswith("Extension modules:")]  # faulthandler's module list
    for ln in reversed(tail):
        fatal = re.search(r"Fatal Python error.*", ln)  # may follow pytest's test name on the same line
        if fatal or re.match(r"^[\w.]+(Error|Exception|Exit)\b", ln):
            return (fatal.group(0) if fatal else ln)[:300]
    return tail[-1][:300] if tail else ""


class SuiteRunner:
    def __init__(self, args, test_root: Path, alias_dir: Path, work: Path):
        self.args = args
        self.test_root = test_root
        self.alias_dir = alias_dir
        self.work = work

    def _command(self, test_file: str, results: Path, selection: Optional[Path], preimports: List[str]) -> List[str]:
        a = self.args
        rank_args = ["--results", str(results)]
        if selection is not None:
            rank_args += ["--selection", str(selection)]
        for m in preimports:
            rank_args += ["--preimport", m]
        # -s and no logging plugin: what a rank prints and aiacc's warnings (the stall inspector's
        # names the tensors and ranks of a hang) go straight into the rank's log, even from a test
        # that is killed before pytest could show its captured output.
        pytest_args = [test_file, "-c", str(self.work / "pytest.ini"), "--rootdir", str(self.test_root),
                       "-p", "no:cacheprovider", "-p", "no:logging", "-s", "-v", "-rN"]
        if a.k:
            pytest_args += ["-k", a.k]
        code = f"import sys, {MODULE_NAME}; sys.exit({MODULE_NAME}.rank_main())"
        return [a.aiaccrun, "-np", str(ranks_of(test_file, a.np)), a.python, "-c", code, *rank_args, "--",
                *pytest_args]

    def _env(self) -> Dict[str, str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(self.alias_dir), env.get("PYTHONPATH", "")) if p)
        env.setdefault("PYTHONFAULTHANDLER", "1")  # a crashing rank prints its Python stack into its log
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        # the stall inspector reports (on rank 0) well before a hang is declared
        env.setdefault("AIACC_STALL_CHECK_SECONDS", f"{max(1.0, min(60.0, self.args.test_timeout / 3)):g}")
        return env

    def _kill(self, proc: subprocess.Popen, ranks: List[RankState], job_dir: Path, stacks: bool) -> None:
        """Ends the job: the launcher's process group (aiaccrun, mpiexec), then any rank still alive.

        With ``stacks``, each rank first writes the stacks of its threads into its log (SIGUSR1).
        """
        if stacks:
            for st in ranks:
                if st.pid is not None and _is_rank_of(st.pid, job_dir):
                    try:
                        os.kill(st.pid, signal.SIGUSR1)
                    except ProcessLookupError:
                        pass
            time.sleep(1.0)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass
            give_up = time.time() + 5.0
            while time.time() < give_up:
                alive = [st.pid for st in ranks if st.pid is not None and _is_rank_of(st.pid, job_dir)]
                if proc.poll() is not None and not alive:
                    return
                if proc.poll() is not None or time.time() > give_up - 2.5:
                    for pid in alive:  # mpiexec is gone or slow to clean up: end them directly
                        try:
                            os.kill(pid, sig)
                        except ProcessLookupError:
                            pass
                time.sleep(0.1)

    def _run_job(self, job_dir: Path, test_file: str, selection: Optional[List[str]], preimports: List[str],
                 deadline: float) -> JobEnd:
        a = self.args
        job_dir.mkdir(parents=True)
        sel_path = None
        if selection is not None:
            sel_path = job_dir / "selection.json"
            sel_path.write_text(json.dumps(selection))
        cmd = self._command(test_file, job_dir, sel_path, preimports)
        ranks = [RankState(job_dir / f"rank{r}.jsonl") for r in range(ranks_of(test_file, a.np))]
        with open(job_dir / "launcher.log", "wb") as log:
            proc = subprocess.Popen(cmd, env=self._env(), cwd=str(self.test_root), stdout=log,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        started = time.time()
        all_finished_at: Optional[float] = None
        reason = "exited"
        while proc.poll() is None:
            time.sleep(a.poll)
            now = time.time()
            for st in ranks:
                st.refresh()
            if now > deadline:
                reason = "suite-timeout"
            elif any(st.collected is None for st in ranks):
                if now - started > a.startup_timeout:
                    reason = "startup-timeout"
            elif all(st.finished for st in ranks):
                all_finished_at = all_finished_at or now
                if now - all_finished_at > a.exit_timeout:
                    reason = "exit-timeout"
            elif any(not st.finished and now - self._busy_since(st) > a.test_timeout for st in ranks):
                reason = "hang"
            if reason != "exited":
                self._kill(proc, ranks, job_dir, stacks=reason == "hang")
                break
        status = proc.wait()
        for st in ranks:
            st.refresh()
        return JobEnd(reason, status, ranks)

    @staticmethod
    def _busy_since(st: RankState) -> float:
        """When the rank began what it is doing now: its current test, or the wait since its last event."""
        if st.current is not None:
            return st.tests[st.current].start
        return st.last_event

    @staticmethod
    def _next_test(st: RankState, order: List[str]) -> Optional[str]:
        if st.current is not None:
            return st.current
        return next((t for t in (st.collected or order) if not st.ended(t)), None)

    def run(self, suite: str, test_file: str, source: str) -> SuiteReport:
        a = self.args
        report = SuiteReport(suite=suite, file=test_file, np=ranks_of(test_file, a.np), source=source)
        preimports = list(a.preimport) if a.preimport is not None else default_preimports(test_file)
        begun = time.time()
        deadline = begun + a.suite_timeout
        order: Optional[List[str]] = None
        results: Dict[str, TestResult] = {}
        remaining: Optional[List[str]] = None
        suite_dir = self.work / "jobs" / Path(test_file).stem
        while True:
            report.jobs += 1
            job_dir = suite_dir / f"job{report.jobs}"
            _progress(f"{Path(test_file).name}: job {report.jobs} "
                      f"({'all tests' if remaining is None else f'{len(remaining)} tests'})")
            end = self._run_job(job_dir, test_file, remaining, preimports, deadline)
            ranks = end.ranks
            if order is None:
                order = ranks[0].collected
                errors = sorted({e for st in ranks for e in st.collect_errors})
                if errors:
                    report.errors += [f"collection error: {e}" for e in errors]
                if order is None or (errors and not order):
                    report.errors.append(f"no test was collected (job {end.reason}, exit status {end.status}); "
                                         f"rank 0's log ends: {_last_line(job_dir / 'rank0.log')!r}")
                    break
            job_order = ranks[0].collected or remaining or order
            progressed = False
            for nodeid in job_order:
                if nodeid not in results and all(st.ended(nodeid) for st in ranks):
                    results[nodeid] = merge(nodeid, ranks)
                    progressed = True
            if end.reason == "exit-timeout":
                report.errors.append(f"job {report.jobs} did not exit within {a.exit_timeout:g} s of its last "
                                     "test and was killed")
            culprit = self._culprit(end, ranks, job_order, results, job_dir)
            if culprit is not None:
                results[culprit.nodeid] = culprit
                progressed = True
                _progress(f"  {culprit.outcome}: {culprit.nodeid}: {culprit.message}")
            remaining = [t for t in order if t not in results]
            if not remaining:
                break
            if end.reason == "suite-timeout" or time.time() > deadline:
                report.errors.append(f"suite timeout ({a.suite_timeout:g} s): {len(remaining)} tests not run")
                break
            if not progressed:
                report.errors.append(f"job {report.jobs} ended ({end.reason}, exit status {end.status}) without "
                                     f"finishing any test; rank 0's log ends: {_last_line(job_dir / 'rank0.log')!r}")
                break
        for nodeid in order or []:
            report.tests.append(results.get(nodeid) or TestResult(nodeid, NOT_RUN))
        report.seconds = round(time.time() - begun, 1)
        return report

    def _culprit(self, end: JobEnd, ranks: List[RankState], order: List[str], results: Dict[str, TestResult],
                 job_dir: Path) -> Optional[TestResult]:
        """The test a hang or an abort is charged to: the earliest one some rank has not finished."""
        if end.reason not in ("hang", "exited"):
            return None
        index = {t: i for i, t in enumerate(order)}
        candidates = []
        for st in ranks:
            if st.finished:
                continue
            test = st.current if end.reason == "exited" else self._next_test(st, order)
            if test is not None and test not in results:
                candidates.append(test)
        if not candidates:
            return None
        nodeid = min(candidates, key=lambda t: index.get(t, len(index)))
        stuck = [r for r, st in enumerate(ranks) if not st.ended(nodeid)]
        done = [f"rank {r}: {st.tests[nodeid].outcome}"
                + (f" ({st.tests[nodeid].message})" if st.tests[nodeid].message else "")
                for r, st in enumerate(ranks) if st.ended(nodeid)]
        others = f"; {', '.join(done)}" if done else ""
        where = ", ".join(str(r) for r in stuck)
        detail = "\n\n".join(f"--- rank {r} log tail ---\n{_without_harness_frames(_log_tail(job_dir / f'rank{r}.log', 300))}"
                               for r in stuck)
        if end.reason == "hang":
            message = f"no result after {self.args.test_timeout:g} s on rank {where}{others}"
            stall = _stall_report(job_dir / "rank0.log", nodeid)
            if stall:
                message += f"; aiacc stall report: {stall}"
            return TestResult(nodeid, HANG, message, ranks={r: HANG for r in stuck}, detail=detail)
        last = "; ".join(f"rank {r}'s log ends: {_last_line(job_dir / f'rank{r}.log')!r}" for r in stuck)
        message = f"job ended (exit status {end.status}) during the test on rank {where}{others}; {last}"
        return TestResult(nodeid, ABORT, message, ranks={r: ABORT for r in stuck}, detail=detail)


def default_preimports(test_file: str) -> List[str]:
    """Modules imported on each rank before pytest starts.

    Horovod's MXNet suites import ``mxnet`` before ``horovod.mxnet``; MXNet 1.9.1 cannot be imported
    on numpy >= 1.24 until ``numpy.bool`` is restored, which ``aiacc.mxnet`` does first (see its
    docstring). Importing the alias first gives the suites the order aiacc documents.
    """
    return ["horovod.mxnet"] if "mxnet" in Path(test_file).name else []


def _progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# Horovod's files and the temporary directory
# ---------------------------------------------------------------------------------------------

def _git(git_dir: Path, *args: str, binary: bool = False):
    out = subprocess.run(["git", f"--git-dir={git_dir}", *args], capture_output=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"horovod_suites: git {' '.join(args)} failed in {git_dir}: "
                         f"{out.stderr.decode(errors='replace').strip()}")
    return out.stdout if binary else out.stdout.decode()


def _is_git_dir(path: Path) -> bool:
    return (path / "HEAD").is_file() and (path / "objects").is_dir()


def materialize(horovod: Path, dest: Path, rev: str = "HEAD") -> str:
    """Copies what the suites need of Horovod's ``test/`` into ``dest``; returns where it came from.

    ``horovod`` is a checkout (its work tree is read, local edits included) or a git directory
    (bare, or a checkout's ``.git``), read at ``rev`` with ``git archive``.
    """
    horovod = horovod.resolve()
    if (horovod / "test" / "parallel").is_dir() and rev == "HEAD":
        for rel in SUPPORT_PATHS:
            src = horovod / rel
            if src.is_dir():
                shutil.copytree(src, dest / rel, ignore=shutil.ignore_patterns("__pycache__"))
            elif src.is_file():
                (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dest / rel)
        return f"checkout {horovod}"
    git_dir = horovod if _is_git_dir(horovod) else horovod / ".git"
    if not _is_git_dir(git_dir):
        raise SystemExit(f"horovod_suites: {horovod} is neither a Horovod checkout (no test/parallel) "
                         "nor a git directory")
    commit = _git(git_dir, "rev-parse", "--verify", f"{rev}^{{commit}}").strip()
    names = _git(git_dir, "ls-tree", "-r", "--name-only", commit, "--", *SUPPORT_PATHS).splitlines()
    if not any(n.startswith("test/parallel/") for n in names):
        raise SystemExit(f"horovod_suites: {git_dir} at {commit[:12]} has no test/parallel")
    data = _git(git_dir, "archive", "--format=tar", commit, "--", *names, binary=True)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(dest, filter="data")
        else:
            tar.extractall(dest)
    return f"git {git_dir} at {commit[:12]}"


def prepare_alias(alias_dir: Path) -> None:
    """The alias package and this file (the rank side), for the front of the ranks' PYTHONPATH."""
    (alias_dir / "horovod").mkdir(parents=True)
    (alias_dir / "horovod" / "__init__.py").write_text(ALIAS_INIT)
    shutil.copy2(Path(__file__).resolve(), alias_dir / f"{MODULE_NAME}.py")


def resolve_suite(name: str, test_root: Path) -> str:
    rel = SUITES.get(name, name)
    if not (test_root / rel).is_file():
        known = ", ".join(SUITES)
        raise SystemExit(f"horovod_suites: no test file {rel!r} in the Horovod repository "
                         f"(suites: {known}, or a path such as test/parallel/test_torch.py)")
    return rel


# ---------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------

def format_table(reports: List[SuiteReport]) -> str:
    head = ["suite", "np", PASSED, FAILED, SKIPPED, "hang/abort", NOT_RUN, "seconds"]
    rows = []
    for r in reports:
        c = r.counts()
        rows.append([Path(r.file).name, r.np, c[PASSED], c[FAILED], c[SKIPPED], c[HANG] + c[ABORT],
                     c[NOT_RUN], f"{r.seconds:.0f}"])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    fmt = lambda row: "  ".join(str(x).ljust(w) if i == 0 else str(x).rjust(w)  # noqa: E731
                                for i, (x, w) in enumerate(zip(row, widths)))
    out = [fmt(head), fmt(["-" * w for w in widths])] + [fmt(row) for row in rows]
    for r in reports:
        bad = [t for t in r.tests if t.outcome in (FAILED, HANG, ABORT)]
        if bad or r.errors:
            out.append("")
            out.append(f"{Path(r.file).name} ({r.source}):")
        for e in r.errors:
            out.append(f"  ERROR {e}")
        for t in bad:
            name = t.nodeid.split("::", 1)[-1]
            out.append(f"  {t.outcome:6} {name}: {t.message}")
    return "\n".join(out)


def exit_status(reports: List[SuiteReport]) -> int:
    if any(r.errors and not any(t.outcome != NOT_RUN for t in r.tests) for r in reports):
        return 2
    if any(t.outcome in (FAILED, HANG, ABORT, NOT_RUN) for r in reports for t in r.tests) or any(r.errors for r in reports):
        return 1
    return 0


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="horovod_suites.py",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run Horovod's own test suites against aiacc (through an alias package `horovod`).",
        epilog="Example:\n  python tools/horovod_suites.py --horovod ~/src/horovod torch mxnet1 --json out.json\n"
               f"Suites: {', '.join(f'{k} ({v})' for k, v in SUITES.items())}.")
    p.add_argument("suites", nargs="+", metavar="SUITE",
                   help="a suite name or the path of a test file inside the Horovod repository")
    p.add_argument("--horovod", required=True, type=Path, metavar="PATH",
                   help="a Horovod checkout, or a git directory of one (bare or .git)")
    p.add_argument("--rev", default="HEAD", help="commit to read from a git directory (default HEAD)")
    p.add_argument("--np", type=int, default=2, help="ranks per job (default 2)")
    p.add_argument("--test-timeout", type=float, default=300.0, metavar="S",
                   help="a test unfinished on some rank after S seconds is a hang (default 300)")
    p.add_argument("--suite-timeout", type=float, default=7200.0, metavar="S",
                   help="wall clock limit of one suite, restarts included (default 7200)")
    p.add_argument("--startup-timeout", type=float, default=600.0, metavar="S",
                   help="limit for a job to import and collect its tests (default 600)")
    p.add_argument("--exit-timeout", type=float, default=60.0, metavar="S",
                   help="limit for a job to exit after its last test (default 60)")
    p.add_argument("-k", metavar="EXPR", help="pytest -k expression selecting tests")
    p.add_argument("--preimport", action="append", metavar="MODULE",
                   help="module each rank imports before pytest (default: horovod.mxnet for MXNet suites)")
    p.add_argument("--json", type=Path, metavar="FILE", help="write every result as JSON to FILE")
    p.add_argument("--work-dir", type=Path, metavar="DIR",
                   help="keep the Horovod files, alias and per-rank logs in DIR (default: a temporary directory, removed)")
    p.add_argument("--python", default=sys.executable, help="Python of the ranks (default: this one)")
    p.add_argument("--aiaccrun", help="aiaccrun to launch with (default: the one beside --python)")
    p.add_argument("--poll", type=float, default=0.5, help=argparse.SUPPRESS)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    if args.np < 1:
        raise SystemExit("horovod_suites: --np must be at least 1")
    if args.aiaccrun is None:
        beside = Path(args.python).parent / "aiaccrun"
        args.aiaccrun = str(beside) if beside.exists() else shutil.which("aiaccrun")
        if args.aiaccrun is None:
            raise SystemExit("horovod_suites: no aiaccrun beside the Python or on PATH (pip install -e .)")
    if args.work_dir is not None:
        args.work_dir.mkdir(parents=True, exist_ok=True)
        if any(args.work_dir.iterdir()):
            raise SystemExit(f"horovod_suites: --work-dir {args.work_dir} is not empty")
        work, cleanup = args.work_dir.resolve(), None
    else:
        cleanup = tempfile.TemporaryDirectory(prefix="horovod_suites.")
        work = Path(cleanup.name)
    try:
        test_root = work / "horovod"
        source = materialize(args.horovod, test_root, args.rev)
        alias_dir = work / "alias"
        prepare_alias(alias_dir)
        (work / "pytest.ini").write_text("[pytest]\n")
        files = [resolve_suite(s, test_root) for s in args.suites]
        runner = SuiteRunner(args, test_root, alias_dir, work)
        reports = [runner.run(suite, f, source) for suite, f in zip(args.suites, files)]
    finally:
        if cleanup is not None:
            cleanup.cleanup()
    print(format_table(reports))
    if args.json is not None:
        args.json.write_text(json.dumps({"reports": [r.to_json() for r in reports]}, indent=1) + "\n")
    return exit_status(reports)


if __name__ == "__main__":
    sys.exit(main())
