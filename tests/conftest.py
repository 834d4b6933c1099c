"""Helpers for tests that run real multi-process jobs.

Every multi-rank test starts ``aiaccrun`` (``python -m aiacc.launcher``),
which launches through the mpiexec of the MPI that mpi4py uses, runs a
worker script from tests/workers/ on each rank, and returns what the job
printed. A job that does not end within its timeout is killed and the test
fails with what it printed so far: a hang is a failure, never a wait.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional, Sequence

import pytest

HERE = Path(__file__).resolve().parent
WORKERS = HERE / "workers"
ROOT = HERE.parent


@dataclass
class Job:
    returncode: int
    output: str
    seconds: float

    def lines(self, prefix: str):
        return [line for line in self.output.splitlines() if line.startswith(prefix)]


def base_env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIACC_")}
    env.update({
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": str(WORKERS) + os.pathsep + env.get("PYTHONPATH", ""),
        "TF_CPP_MIN_LOG_LEVEL": "2",
        "KMP_WARNINGS": "0",
    })
    if extra:
        env.update(extra)
    return env


def run(cmd: Sequence[str], env: Optional[Dict[str, str]] = None, timeout: float = 120) -> Job:
    """Run ``cmd`` in its own process group; kill the whole group on timeout."""
    start = time.monotonic()
    proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=base_env(env), cwd=str(ROOT), start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)  # lets cleanup code run (e.g. namespaces of --link)
        try:
            out, _ = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        pytest.fail(f"job did not end within {timeout} s (hang): {' '.join(cmd)}\n--- output ---\n{out}")
    return Job(proc.returncode, out, time.monotonic() - start)


def aiaccrun(np: int, script: str, *args: str, env: Optional[Dict[str, str]] = None, timeout: float = 120,
             flags: Sequence[str] = ()) -> Job:
    """``aiaccrun -np N [flags] python tests/workers/<script> args...``"""
    cmd = [sys.executable, "-m", "aiacc.launcher", "-np", str(np), *flags,
           sys.executable, str(WORKERS / script), *args]
    return run(cmd, env=env, timeout=timeout)


def python(script: str, *args: str, env: Optional[Dict[str, str]] = None, timeout: float = 120) -> Job:
    """One plain process (no MPI launcher)."""
    return run([sys.executable, str(WORKERS / script), *args], env=env, timeout=timeout)


def assert_ok(job: Job, np: int, marker: str = "OK", checks=None) -> None:
    """The job exited 0 and every rank printed ``<marker> rank=<r>``; with ``checks`` (a number, or a
    function of the rank), also ``checks=<n>``: every check the worker has ran, none skipped."""
    assert job.returncode == 0, f"job failed with status {job.returncode}:\n{job.output}"
    for r in range(np):
        want = f"{marker} rank={r}"
        if checks is not None:
            want += f" checks={checks(r) if callable(checks) else checks}"
        assert want in job.output, f"rank {r} did not report {want!r}:\n{job.output}"


def example_epochs(job: Job) -> list:
    """(loss, test accuracy) of each epoch that an example of examples/ printed (rank 0's lines)."""
    found = re.findall(r"^epoch +\d+ +loss (\S+) +test accuracy (\S+)", job.output, re.M)
    return [(float(loss), float(accuracy)) for loss, accuracy in found]


def assert_trains_as_one_process(one: Job, many: Job, epochs: int) -> None:
    """An example run on several ranks (``many``) printed, epoch by epoch, the loss and test accuracy of its
    one-process run (``one``): the loss to its 4 printed decimals and the accuracy to one test sample (of 450),
    give or take float rounding (the ranks' sums are added in another order)."""
    assert one.returncode == 0, one.output
    assert many.returncode == 0, many.output
    alone, together = example_epochs(one), example_epochs(many)
    assert len(alone) == len(together) == epochs, (one.output, many.output)
    for epoch, ((loss1, acc1), (loss_n, acc_n)) in enumerate(zip(alone, together), 1):
        assert abs(loss1 - loss_n) <= 1.5e-4 and abs(acc1 - acc_n) <= 2.5e-3, \
            f"epoch {epoch}: one process {(loss1, acc1)}, several ranks {(loss_n, acc_n)}\n{many.output}"


TENSORFLOW = ("tensorflow", "tensorflow-cpu")  # the distributions TensorFlow comes in ([tensorflow] installs the first)


def need_framework(module: str, distribution=None) -> None:
    """Skip the calling test module when ``distribution`` (default ``module``; a tuple: any of them) is not
    installed, with the reason shown; when it is installed, import ``module`` so that a broken install fails the
    run instead of quietly skipping tests that CI is meant to run (``[all]`` installs every framework)."""
    import importlib
    import importlib.metadata

    names = distribution if isinstance(distribution, tuple) else (distribution or module,)
    for name in names:
        try:
            importlib.metadata.distribution(name)
            break
        except importlib.metadata.PackageNotFoundError:
            continue
    else:
        pytest.skip(f"{' or '.join(names)} is not installed (pip install -e '.[all]')", allow_module_level=True)
    if module == "mxnet":
        importlib.import_module("aiacc.mxnet")  # restores numpy.bool, which MXNet 1.9.1 needs, first
    importlib.import_module(module)


@pytest.fixture
def tmp_out(tmp_path):
    return tmp_path
