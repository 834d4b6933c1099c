"""Hierarchical allreduce (within hosts, across hosts, back within hosts) on emulated hosts."""

import pytest

from conftest import aiaccrun, assert_ok


@pytest.mark.parametrize("np_,per_host", [(3, 2), (2, 1)])
def test_hierarchical_allreduce_equals_flat_on_emulated_hosts(np_, per_host):
    job = aiaccrun(np_, "hierarchy.py", env={"AIACC_HIERARCHICAL_ALLREDUCE": "1", "AIACC_HOSTS_PER_NODE": str(per_host)})
    assert_ok(job, np_)
    assert job.output.count("hierarchical=True") == np_
    if np_ == 3:  # hosts {0,1} and {2}
        assert "OK rank=1 local=1/2 cross=0/1" in job.output and "OK rank=2 local=0/1 cross=1/2" in job.output, job.output
    assert job.output.count(f"homogeneous={np_ % per_host == 0}") == np_, job.output


def test_topology_without_emulation_is_one_host():
    job = aiaccrun(2, "hierarchy.py")
    assert_ok(job, 2)
    assert "OK rank=1 local=1/2 cross=0/1" in job.output, job.output
    assert job.output.count("homogeneous=True") == 2, job.output
