"""``aiacc.summary()`` and ``AIACC_SUMMARY`` / ``aiaccrun --summary``: what the engine did, counted."""

import re
import sys

from conftest import aiaccrun, assert_ok, run


def test_summary_counts_requests_collectives_bytes_agreement_and_rank_0_prints_it_at_shutdown():
    job = aiaccrun(2, "summary.py", flags=["--summary"])
    assert_ok(job, 2)  # the worker checks the dict (requests, bytes, agreement, kinds)
    lines = [line for line in job.output.splitlines() if line.startswith("aiacc rank ")]
    assert len(lines) == 1 and lines[0].startswith("aiacc rank 0 of 2: 33 allreduce requests in "), job.output
    cached, collectives = re.search(r"OK rank=0 cached=(\d+) collectives=(\d+)", job.output).groups()
    assert f"in {collectives} collectives" in lines[0], lines[0]  # the line says what the dict says
    assert f"{cached} operations agreed from the response cache and {39 - int(cached)} by full negotiation" \
        in lines[0], lines[0]
    assert "other collectives: 3 broadcast, 3 allgather;" in lines[0], lines[0]
    # one host: the fused buffers went through the shared-memory window, which the line counts (it said nothing:
    # the window was freed, and its count with it, before the line was made)
    shared = int(re.search(r"OK rank=0 .* shared=(\d+)", job.output).group(1))
    assert shared > 0 and f"{shared} through the shared-memory window" in lines[0], (shared, lines[0])


def test_no_summary_unless_asked_and_the_flag_sets_the_variable():
    job = aiaccrun(2, "summary.py")
    assert_ok(job, 2)
    assert "aiacc rank 0 of 2" not in job.output, job.output
    job = run([sys.executable, "-m", "aiacc.launcher", "-np", "2", "--summary", "--print-command", "python", "t.py"])
    assert job.returncode == 0 and "-genv AIACC_SUMMARY 1" in job.output, job.output
