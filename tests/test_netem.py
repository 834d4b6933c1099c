"""The emulated cluster link of `python -m aiacc.bench --link RATE`."""

import json
import os
import shutil
import sys

import pytest

from aiacc.bench.netem import LinkError, parse_rate
from conftest import run

needs_root = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("tc") is None,
                                reason="network namespaces need root and iproute2 (tc)")


def bench(*args):
    return run([sys.executable, "-m", "aiacc.bench", *args], timeout=180)


def test_rates_parse_and_bad_rates_are_named():
    assert parse_rate("1gbit") == 1e9 and parse_rate("100mbit") == 1e8 and parse_rate("unlimited") is None
    with pytest.raises(LinkError, match="--link 'fast': expected a rate > 0 such as"):
        parse_rate("fast")


@needs_root
def test_every_byte_crosses_the_capped_link():
    job = bench("--link", "50mbit", "allreduce", "--min-bytes", "256KiB", "--max-bytes", "256KiB",
                "--repeats", "1", "--target-seconds", "0.2", "--json")
    assert job.returncode == 0, job.output
    rec = json.loads([line for line in job.output.splitlines() if line.startswith("{")][0])
    assert rec["bytes"] == 256 * 1024
    # 50 Mbit/s is 6.25 MB/s: both MPI directly and the engine stay far below unshaped loopback
    assert rec["raw_busbw_GBps"] < 0.02 and rec["aiacc_busbw_GBps"] < 0.02, rec


def test_link_is_refused_inside_an_mpi_job():
    job = run([sys.executable, "-m", "aiacc.launcher", "-np", "2", sys.executable, "-m", "aiacc.bench", "--link",
               "1gbit", "allreduce"], timeout=60)
    assert job.returncode == 2 and "run it without aiaccrun" in job.output, job.output


def test_link_without_root_says_what_it_needs():
    setpriv = shutil.which("setpriv")
    if os.geteuid() != 0 or setpriv is None:
        pytest.skip("needs root to drop capabilities with setpriv")
    # still root (so the checkout stays readable), without the two capabilities a namespace needs
    job = run([setpriv, "--bounding-set=-net_admin,-sys_admin", "--inh-caps=-all", sys.executable, "-m",
               "aiacc.bench", "--link", "1gbit", "allreduce"], timeout=60)
    assert job.returncode == 2
    assert "needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN)" in job.output, job.output
