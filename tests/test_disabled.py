"""The switch: with AIACC_ENABLE unset nothing starts and nothing changes."""

import sys

from conftest import WORKERS, assert_ok, python, run


def test_disabled_is_rank_0_of_1_without_mpi():
    assert_ok(python("disabled.py"), 1)
    assert_ok(python("disabled.py", env={"AIACC_ENABLE": "0"}), 1)


def test_disabled_inside_a_multi_rank_job_warns_each_rank_trains_alone():
    from aiacc.launcher import find_mpiexec

    mpiexec, _ = find_mpiexec()
    job = run([mpiexec, "-n", "2", sys.executable, str(WORKERS / "disabled.py")])
    assert job.returncode == 0, job.output
    assert job.output.count("OK rank=0") == 2
    assert job.output.count("each rank trains alone") == 2, job.output


def test_core_imports_no_framework():
    assert_ok(python("no_frameworks.py"), 1)
