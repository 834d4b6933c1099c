"""Fusion buffers reduced through a shared-memory window on one host (``aiacc.transport.shm``)."""

import pytest

from conftest import aiaccrun, assert_ok

# per step: 4 dtypes x 5 ops x (24 tensors + the same-bytes check), the new results, the group; then joins
# with each rank joining first, of cached and new names
STEPS_CHECKS = 4 * (4 * 5 * 25 + 2)


@pytest.mark.parametrize("np_", [2, 3])
def test_shared_window_results_equal_the_reference(np_):
    job = aiaccrun(np_, "shared_window.py", env={"AIACC_SHM_BYTES": "16KiB", "AIACC_FUSION_THRESHOLD": "64KiB"})
    assert_ok(job, np_, checks=STEPS_CHECKS + 2 * np_ + 3)
    assert "window=0" not in job.output, job.output


def test_without_the_window_mpi_reduces_the_same():
    job = aiaccrun(2, "shared_window.py", env={"AIACC_SHM_BYTES": "0", "AIACC_FUSION_THRESHOLD": "64KiB"})
    assert_ok(job, 2, checks=STEPS_CHECKS + 4)


def test_a_rank_without_the_window_leaves_every_rank_on_mpi():
    job = aiaccrun(3, "shared_window_fallback.py")
    assert_ok(job, 3, checks=3)
    assert "no shared-memory window on rank 1" in job.output and "no shared windows here" in job.output, job.output
