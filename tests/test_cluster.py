"""Emulated hosts (python -m aiacc.bench cluster): namespaces joined by shaped veth links, ranks started by hydra.

The tests that make namespaces need root (CI runs as root); without it they skip, as in test_netem.
"""

import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from aiacc.bench.cluster import ClusterError, EmulatedCluster, parse_latency
from conftest import WORKERS, run

needs_root = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("tc") is None,
                                reason="network namespaces need root and iproute2 (tc)")


def bench(*args, timeout=120):
    return run([sys.executable, "-m", "aiacc.bench", *args], timeout=timeout)


def leftovers(name):
    """Namespaces, links and state of emulated cluster ``name`` that still exist."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    out += subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    found = re.findall(rf"aiacc-emu-{name}-h\d+|aiaccbr-{name}\b|aiv{name}h\d+", out)
    if os.path.exists(f"/run/aiacc-cluster/{name}"):
        found.append(f"/run/aiacc-cluster/{name}")
    found += [f"/etc/netns/{d}" for d in (os.listdir("/etc/netns") if os.path.isdir("/etc/netns") else [])
              if d.startswith(f"aiacc-emu-{name}-")]
    return found


def ns_pids(name):
    pids = []
    for i in range(2):
        out = subprocess.run(["ip", "netns", "pids", f"aiacc-emu-{name}-h{i}"], capture_output=True, text=True)
        pids += out.stdout.split()
    return pids


def test_bad_cluster_settings_are_named():
    with pytest.raises(ClusterError, match="--latency 'soon': expected a time"):
        parse_latency("soon")
    assert parse_latency("50us") == pytest.approx(5e-5) and parse_latency("0") == 0
    with pytest.raises(ClusterError, match="--hosts 0: an emulated cluster needs at least 1 host"):
        EmulatedCluster(hosts=0)
    with pytest.raises(ClusterError, match="--name 'Big-Name'"):
        EmulatedCluster(hosts=2, name="Big-Name")
    with pytest.raises(ClusterError, match="--link '3 pigeons'"):
        EmulatedCluster(hosts=2, rate="3 pigeons")
    with pytest.raises(ClusterError, match="--link '1gbit' with --dilate 1e-300 leaves inf bit/s"):
        EmulatedCluster(hosts=2, rate="1gbit", dilate=1e-300)
    with pytest.raises(ClusterError, match="--link '20tbit' with --dilate 1 leaves 2e\\+13 bit/s; tc shapes from 8000"):
        EmulatedCluster(hosts=2, rate="20tbit")
    with pytest.raises(ClusterError, match="--latency '1s' with --dilate 100 leaves 100 s one way"):
        EmulatedCluster(hosts=2, latency="1s", dilate=100)


def test_status_says_when_no_cluster_is_up():
    status = bench("cluster", "status")
    if status.output.startswith("cluster="):
        pytest.skip("an emulated cluster is up on this machine")
    assert status.returncode == 0 and "no emulated cluster is up" in status.output, status.output


def test_aiaccrun_names_a_cluster_that_is_not_up():
    job = run([sys.executable, "-m", "aiacc.launcher", "--emulated-cluster", "nosuch", "-np", "2", "true"], timeout=60)
    assert job.returncode == 2 and "no emulated cluster 'nosuch' is up" in job.output, job.output


def test_cluster_without_root_says_what_it_needs():
    setpriv = shutil.which("setpriv")
    if os.geteuid() != 0 or setpriv is None:
        pytest.skip("needs root to drop capabilities with setpriv")
    job = run([setpriv, "--bounding-set=-net_admin,-sys_admin", "--inh-caps=-all", sys.executable, "-m",
               "aiacc.bench", "cluster", "up", "--hosts", "2", "--name", "tnorot"], timeout=60)
    assert job.returncode == 2
    assert "needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN)" in job.output, job.output
    assert not leftovers("tnorot")
    # a cluster that is up: `down` without the rights says so and leaves it whole (it said "removed" and left it)
    assert bench("cluster", "up", "--hosts", "3", "--name", "tnorot").returncode == 0
    try:
        down = run([setpriv, "--bounding-set=-net_admin,-sys_admin", "--inh-caps=-all", sys.executable, "-m",
                    "aiacc.bench", "cluster", "down", "--name", "tnorot"], timeout=60)
        assert down.returncode == 2 and "needs root (CAP_NET_ADMIN" in down.output, down.output
        assert "removed" not in down.output and "cluster=tnorot" in bench("cluster", "status").output
        # without -H, 4 ranks spread evenly over the 3 hosts (hydra fills them in order): 2, 1, 1
        cmd = run([sys.executable, "-m", "aiacc.launcher", "--emulated-cluster", "tnorot", "-np", "4",
                   "--print-command", "true"], timeout=60)
        assert cmd.returncode == 0 and re.search(r"-hosts 10\.\d+\.\d+\.1:2,10\.\d+\.\d+\.2:1,10\.\d+\.\d+\.3:1 ",
                                                 cmd.output), cmd.output
    finally:
        assert bench("cluster", "down", "--name", "tnorot").returncode == 0
    assert not leftovers("tnorot")


@needs_root
def test_two_hosts_share_memory_within_and_cross_the_shaped_link_between():
    name = "ttraf"
    bench("cluster", "down", "--name", name)  # (one left up by an interrupted run of this test; none: a no-op)
    up = bench("cluster", "up", "--hosts", "2", "--link", "2gbit", "--name", name)
    try:
        assert up.returncode == 0, up.output
        again = bench("cluster", "up", "--hosts", "2", "--name", name)
        assert again.returncode == 2 and f"emulated cluster '{name}' is already up" in again.output, again.output
        stranger = run([sys.executable, "-m", "aiacc.launcher", "--emulated-cluster", name, "-np", "2", "-H",
                        "nodeA:2", "true"], timeout=60)
        assert stranger.returncode == 2 and f"host 'nodeA' is not in emulated cluster '{name}'" in stranger.output
        for hierarchical in ("0", "1"):
            job = run([sys.executable, "-m", "aiacc.launcher", "--emulated-cluster", name, "-np", "4", "-H",
                       "h0:2,h1:2", sys.executable, str(WORKERS / "cluster_traffic.py"), "2", "2"],
                      env={"AIACC_HIERARCHICAL_ALLREDUCE": hierarchical}, timeout=120)
            assert job.returncode == 0, job.output
            lines = job.lines("OK rank=")
            assert len(lines) == 4, job.output
            for line in lines:
                rec = dict(kv.split("=", 1) for kv in line.split()[1:])
                r = int(rec["rank"])
                assert rec["host"] == up.output.split("hosts=")[1].split()[0].split(",")[r // 2]
                assert rec["hierarchical"] == ("True" if hierarchical == "1" else "False")
                # 16 MiB between the two ranks of a host: shared memory, the link carries (almost) nothing
                assert int(rec["intra_link_bytes"]) < 64 * 1024, line
                # an allreduce of 16 MiB over 2 hosts: each host's link carries at least the buffer
                assert int(rec["allreduce_link_bytes"]) >= 16 << 20, line
                # compressed to float16, the same allreduce puts half as many bytes on the link
                assert int(rec["fp16_link_bytes"]) <= 0.6 * int(rec["allreduce_link_bytes"]), line
        # every byte the hosts sent to each other went through the token bucket of the link
        tbf = subprocess.run(["tc", "-s", "qdisc", "show", "dev", f"aiv{name}h0"], capture_output=True, text=True)
        assert "tbf" in tbf.stdout and "rate 2Gbit" in tbf.stdout, tbf.stdout
        assert int(re.search(r"Sent (\d+) bytes", tbf.stdout).group(1)) >= 2 * (16 << 20) // 2, tbf.stdout
    finally:
        down = bench("cluster", "down", "--name", name)
    assert down.returncode == 0, down.output
    assert not leftovers(name), leftovers(name)


@needs_root
def test_cluster_run_removes_everything_also_when_stopped():
    job = bench("cluster", "run", "--hosts", "2", "--ranks-per-host", "1", "--link", "1gbit", "--",
                sys.executable, str(WORKERS / "cluster_traffic.py"), "2", "1")
    assert job.returncode == 0, job.output
    assert len(job.lines("OK rank=")) == 2, job.output
    assert not [ns for ns in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
                if ns.startswith("aiacc-emu-p")]
    # stopped while its job runs: SIGTERM unwinds through the removal
    proc = subprocess.Popen([sys.executable, "-m", "aiacc.bench", "cluster", "run", "--hosts", "2", "--", "sleep", "60"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    name = f"p{proc.pid % 100000}"
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(f"/run/aiacc-cluster/{name}/launch") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert leftovers(name), "the cluster never came up"
        while not ns_pids(name) and time.monotonic() < deadline:  # the ranks run inside the hosts
            time.sleep(0.2)
        inside = ns_pids(name)
        assert inside, "no process ever ran inside the hosts"
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert not leftovers(name), leftovers(name)
    # and the job on it ended too: its ranks and proxies, and the mpiexec that used the cluster's launch hook
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        alive = [p for p in inside if os.path.exists(f"/proc/{p}")] + launched_through(name)
        if not alive:
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"processes of the stopped job are still running: {alive}")


@needs_root
def test_cluster_up_killed_half_way_leaves_nothing_or_what_the_next_up_removes():
    """SIGTERM to `cluster up` while it makes the cluster unwinds through the removal (it had no handler for a
    cluster that stays: half of it was left, listed as up, and the next `up` refused the name); after SIGKILL
    the state names the dead maker, so the next `up` removes what is left and makes the cluster."""
    job = run([sys.executable, str(WORKERS / "cluster_killed_maker.py"), "TERM", "tkt"], timeout=120)
    assert "MADE" not in job.output and not leftovers("tkt"), (job.output, leftovers("tkt"))
    job = run([sys.executable, str(WORKERS / "cluster_killed_maker.py"), "KILL", "tkk"], timeout=120)
    assert job.returncode == -signal.SIGKILL or job.returncode == 128 + signal.SIGKILL, job.output
    assert leftovers("tkk"), "SIGKILL left nothing to clean up: the test proves nothing"
    status = bench("cluster", "status")
    assert "cluster=tkk " in status.output and "stale (its maker died" in status.output, status.output
    try:
        up = bench("cluster", "up", "--hosts", "2", "--name", "tkk")
        assert up.returncode == 0, up.output
    finally:
        bench("cluster", "down", "--name", "tkk")
    assert not leftovers("tkk"), leftovers("tkk")


def test_scaling_refuses_empty_lists_and_cluster_an_empty_name():
    for flag in ("--hosts", "--ranks-per-host", "--link"):
        job = bench("scaling", flag, ",", "--impls", "aiacc")
        assert job.returncode == 2 and f"{flag}: no value given" in job.output, job.output
    with pytest.raises(ClusterError, match="--name '': expected 1-6 lowercase letters or digits"):
        EmulatedCluster(hosts=2, name="")


def launched_through(name):
    mine = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f"/run/aiacc-cluster/{name}/".encode() in f.read():
                    mine.append(pid)
        except OSError:
            pass
    return mine


@needs_root
def test_latency_needs_netem_and_says_so_where_the_kernel_lacks_it():
    job = bench("cluster", "up", "--hosts", "1", "--latency", "50us", "--name", "tlat")
    try:
        if job.returncode == 0:  # this kernel has netem: the delay is on the link
            tc = subprocess.run(["tc", "qdisc", "show", "dev", "aivtlath0"], capture_output=True, text=True).stdout
            assert "netem" in tc and "delay 25us" in tc, tc
        else:
            assert job.returncode == 2 and "needs the kernel's netem queueing discipline" in job.output, job.output
    finally:
        bench("cluster", "down", "--name", "tlat")
    assert not leftovers("tlat")


@needs_root
def test_clusters_side_by_side_get_their_own_subnets_and_names():
    with EmulatedCluster(hosts=1, name="tca") as a, EmulatedCluster(hosts=2, name="tcb", rate="1gbit") as b:
        assert a.state.bridge_ip.rsplit(".", 1)[0] != b.state.bridge_ip.rsplit(".", 1)[0]
        assert b.state.namespaces == ["aiacc-emu-tcb-h0", "aiacc-emu-tcb-h1"]
        assert set(b.counters()) == set(b.state.hosts)
    assert not leftovers("tca") and not leftovers("tcb")
