"""The switch: with AIACC_ENABLE unset nothing starts and nothing changes."""

import sys

from conftest import WORKERS, aiaccrun, assert_ok, python, run


def _results(job):
    return sorted(line for line in job.output.splitlines() if line.startswith("RESULT "))


def test_disabled_is_a_job_of_one_rank_without_mpi():
    """Switched off, collectives give what a real job of one rank gives (ops, scale factors,
    compression, in-place forms) and refuse what it refuses, without starting MPI."""
    off = python("disabled.py")
    assert_ok(off, 1, marker="OK")
    assert "checks=34" in off.output, off.output
    assert _results(python("disabled.py", env={"AIACC_ENABLE": "0"})) == _results(off)
    on = aiaccrun(1, "disabled.py", "on")
    assert_ok(on, 1)
    assert _results(on) == _results(off), (on.output, off.output)


def test_disabled_inside_a_multi_rank_job_warns_each_rank_trains_alone():
    from aiacc.launcher import find_mpiexec

    mpiexec, _ = find_mpiexec()
    job = run([mpiexec, "-n", "2", sys.executable, str(WORKERS / "disabled.py")])
    assert job.returncode == 0, job.output
    assert job.output.count("OK rank=0") == 2
    assert job.output.count("each rank trains alone") == 2, job.output


def test_core_imports_no_framework():
    assert_ok(python("no_frameworks.py"), 1)
