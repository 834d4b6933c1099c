"""An emulated cluster on one machine: one network namespace per host, joined through a bridge by tc-shaped links.

::

    python -m aiacc.bench cluster up --hosts 2 --link 25gbit --latency 50us [--name emu] [--dilate 10]
    aiaccrun --emulated-cluster emu -np 4 -H h0:2,h1:2 python train.py
    python -m aiacc.bench cluster status
    python -m aiacc.bench cluster down [--name emu | --all]
    python -m aiacc.bench cluster run --hosts 2 --ranks-per-host 2 --link 1gbit -- python train.py

What is made (root, CAP_NET_ADMIN + CAP_SYS_ADMIN, iproute2)::

    root namespace: bridge aiaccbr-NAME, 10.213.X.254/24 (mpiexec's control connections come here)
      |-- veth aivNAMEh0 <-> eth0 in namespace aiacc-emu-NAME-h0, 10.213.X.1
      |-- veth aivNAMEh1 <-> eth0 in namespace aiacc-emu-NAME-h1, 10.213.X.2  ...

Each host's link is shaped in both directions: the host's ``eth0`` (what it sends) and its bridge
port (what it receives) each get a token bucket at the link rate with half the one-way latency
in a netem queue under it, so host-to-host traffic meets the rate once each way and the latency
once in total. ``--dilate K`` divides the rate and multiplies the latency by K (to go with
``--dilate K`` of the compute replay).

Ranks are started by MPICH's own launcher: aiaccrun (``--emulated-cluster NAME``, or
``AIACC_EMULATED_CLUSTER``) passes hydra ``-launcher ssh -launcher-exec STATE/launch -localhost
BRIDGE_IP`` and the hosts by their addresses. The ``launch`` script, called by hydra as ``ssh
[-x] HOST COMMAND``, runs the command (hydra's proxy) inside the host's namespace, so the proxy
and the ranks it starts live there. MPICH's nodes are hydra's proxies: ranks of one host talk
through shared memory, ranks of different hosts over TCP (``MPIR_CVAR_CH4_NETMOD=ofi
FI_PROVIDER=tcp FI_TCP_IFACE=eth0``) through the shaped veth. gloo (the DDP baseline) is
pointed at the same interface (``GLOO_SOCKET_IFNAME=eth0``).

State lives in ``/run/aiacc-cluster/NAME/`` (``cluster.json`` and ``launch``). A cluster made by
``cluster run`` or the :class:`EmulatedCluster` context manager is removed when it ends, also
on an exception or SIGTERM; one whose maker died is removed by the next ``up``.

Not emulated: separate CPUs, memories and kernels per host (all share this machine's), NIC
offloads and RDMA (the links carry TCP), switch contention beyond each host's own link.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from .common import positive_float, positive_int
from .netem import LinkError, _has_admin_caps, parse_rate

__all__ = ["ClusterError", "EmulatedCluster", "ClusterState", "parse_latency", "load_state", "STATE_ROOT", "main"]

STATE_ROOT = "/run/aiacc-cluster"
NETNS_ETC = "/etc/netns"  # files `ip netns exec NS` mounts over /etc
SUBNET_PREFIX = "10.213"
HOST_IFACE = "eth0"
# what every rank needs to take TCP through its host's interface (the shaped link)
RANK_ENV = {"MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp", "FI_TCP_IFACE": HOST_IFACE,
            "GLOO_SOCKET_IFNAME": HOST_IFACE}


MIN_RATE_BPS = 8000  # bit/s: the slowest link the emulated cluster sets up (tc's token bucket needs a rate)
MAX_RATE_BPS = 10 ** 13  # bit/s: the fastest (tbf's burst, ~2 ms of traffic, is a 32-bit byte count)
MAX_LATENCY_S = 60.0  # one-way latency after --dilate (netem's delay is a 32-bit count of its ticks)


class ClusterError(Exception):
    """The emulated cluster cannot be made or used; the message says why."""


def parse_latency(text: str) -> float:
    """``"50us"`` -> 5e-5 s; units s, ms, us; ``0`` is none."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(s|ms|us)?\s*", text.lower())
    if not m:
        raise ClusterError(f"--latency {text!r}: expected a time such as 50us, 0.5ms, 0")
    value = float(m.group(1)) * {"s": 1.0, "ms": 1e-3, "us": 1e-6, None: 1.0}[m.group(2)]
    if m.group(2) is None and value != 0:
        raise ClusterError(f"--latency {text!r}: give a unit (s, ms or us)")
    return value


@dataclass
class ClusterState:
    """What ``cluster.json`` holds: enough for aiaccrun to launch and for ``down`` to remove."""

    name: str
    hosts: List[str]  # addresses, host i = hosts[i]
    namespaces: List[str]
    bridge: str
    bridge_ip: str
    veths: List[str]  # the bridge side of each host's link
    rate_bps: Optional[float]
    latency_s: float
    dilate: float
    owner_pid: int  # 0: made by `cluster up`, stays until `cluster down`
    state_dir: str
    launch: str
    mpiexec_args: List[str]
    env: Dict[str, str]

    def host_address(self, name: str) -> str:
        """``h1`` or ``10.213.X.2`` -> the address (aiaccrun's -H accepts either)."""
        if name in self.hosts:
            return name
        m = re.fullmatch(r"h(\d+)", name)
        if m and int(m.group(1)) < len(self.hosts):
            return self.hosts[int(m.group(1))]
        raise ClusterError(f"host {name!r} is not in emulated cluster {self.name!r} "
                           f"(hosts h0..h{len(self.hosts) - 1}: {', '.join(self.hosts)})")


def load_state(name_or_dir: str) -> ClusterState:
    """The state of a running emulated cluster, by name or state directory."""
    d = name_or_dir if os.path.sep in name_or_dir else os.path.join(STATE_ROOT, name_or_dir)
    try:
        with open(os.path.join(d, "cluster.json")) as f:
            return ClusterState(**json.load(f))
    except FileNotFoundError:
        running = _running_names()
        raise ClusterError(f"no emulated cluster {name_or_dir!r} is up (running: {', '.join(running) or 'none'}); "
                           "make one with `python -m aiacc.bench cluster up --hosts N`") from None
    except (OSError, ValueError, TypeError) as exc:
        raise ClusterError(f"emulated cluster state in {d!r} cannot be read: {exc}") from None


def _running_names() -> List[str]:
    try:
        return sorted(n for n in os.listdir(STATE_ROOT) if os.path.exists(os.path.join(STATE_ROOT, n, "cluster.json")))
    except OSError:
        return []


def _run(cmd: Sequence[str]) -> str:
    out = subprocess.run(list(cmd), capture_output=True, text=True)
    if out.returncode != 0:
        raise ClusterError(f"`{' '.join(cmd)}` failed: {(out.stderr or out.stdout).strip()}")
    return out.stdout


def _quiet(cmd: Sequence[str]) -> None:
    subprocess.run(list(cmd), capture_output=True)


_LAUNCH = """#!/bin/sh
# hydra calls this as its ssh: [options] HOST COMMAND...; run COMMAND in HOST's network namespace
while [ "${1#-}" != "$1" ]; do shift; done
host=$1; shift
case "$host" in
%s
*) echo "aiacc emulated cluster %s: no host $host" >&2; exit 255;;
esac
exec ip netns exec "$ns" /bin/sh -c "exec $*"
"""


class EmulatedCluster:
    """``with EmulatedCluster(hosts=2, rate="1gbit", latency="50us") as c: c.run([...], ranks_per_host=2)``.

    Makes the namespaces, bridge, links and state on enter; removes all of it on exit (also after
    an exception or SIGTERM). ``persistent=True`` (``cluster up``) leaves it for ``cluster down``."""

    def __init__(self, hosts: int, rate: str = "unlimited", latency: str = "0", name: Optional[str] = None,
                 dilate: float = 1.0, persistent: bool = False):
        if hosts < 1:
            raise ClusterError(f"--hosts {hosts}: an emulated cluster needs at least 1 host")
        if hosts > 250:
            raise ClusterError(f"--hosts {hosts}: at most 250 hosts fit the emulated cluster's /24 subnet")
        if not 0 < dilate < float("inf"):  # (also NaN)
            raise ClusterError(f"--dilate {dilate}: expected a finite factor > 0")
        try:
            rate_bps = parse_rate(rate)
        except LinkError as exc:
            raise ClusterError(str(exc)) from None
        latency_s = parse_latency(latency)
        self.name = f"p{os.getpid() % 100000}" if name is None else name  # ('' is refused below, not replaced)
        if not re.fullmatch(r"[a-z0-9]{1,6}", self.name):
            raise ClusterError(f"--name {self.name!r}: expected 1-6 lowercase letters or digits "
                               "(it becomes part of interface names, at most 15 characters)")
        self.hosts = hosts
        self.rate_bps = None if rate_bps is None else rate_bps / dilate
        if self.rate_bps is not None and not MIN_RATE_BPS <= self.rate_bps <= MAX_RATE_BPS:
            raise ClusterError(f"--link {rate!r} with --dilate {dilate:g} leaves {self.rate_bps:.3g} bit/s; tc shapes "
                               f"from {MIN_RATE_BPS} to {MAX_RATE_BPS:.0e} bit/s (use --link unlimited for no cap)")
        self.latency_s = latency_s * dilate
        if self.latency_s > MAX_LATENCY_S:
            raise ClusterError(f"--latency {latency!r} with --dilate {dilate:g} leaves {self.latency_s:.3g} s one way; "
                               f"the emulated cluster delays at most {MAX_LATENCY_S:g} s")
        self.dilate = dilate
        self.persistent = persistent
        self.state: Optional[ClusterState] = None
        self._previous: dict = {}

    # -- lifecycle ---------------------------------------------------------------------------------
    def __enter__(self) -> "EmulatedCluster":
        _check_privileges()
        remove_stale()
        # SIGTERM / SIGHUP end the maker through its cleanup: for good for a cluster made for one job, while it
        # is being made for one that stays (`cluster up`: a kill half-way left a half-made cluster behind)
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, _raise_exit) for sig in (signal.SIGTERM, signal.SIGHUP)}
        os.makedirs(STATE_ROOT, exist_ok=True)
        lock = os.open(STATE_ROOT, os.O_RDONLY)
        try:
            # one maker at a time: the name check and the choice of a free subnet hold until it exists
            fcntl.flock(lock, fcntl.LOCK_EX)
            if os.path.exists(os.path.join(STATE_ROOT, self.name, "cluster.json")):
                raise ClusterError(f"emulated cluster {self.name!r} is already up; `python -m aiacc.bench cluster "
                                   f"down --name {self.name}` removes it")
            self._create()
            if self.persistent:  # made: it stays until `cluster down` (till now its maker's pid marked it stale
                self.state.owner_pid = 0  # if the maker died half-way, SIGKILL too: the next `up` removes it)
                self._write_state()
        except BaseException:
            self._destroy()
            raise
        finally:
            os.close(lock)
            if self.persistent:
                self._restore_signals()
        return self

    def __exit__(self, *exc) -> None:
        if not self.persistent:
            self._destroy()

    def _create(self) -> None:
        n, tag = self.hosts, self.name
        subnet = _free_subnet()
        bridge, bridge_ip = f"aiaccbr-{tag}", f"{subnet}.254"
        namespaces = [f"aiacc-emu-{tag}-h{i}" for i in range(n)]
        veths = [f"aiv{tag}h{i}" for i in range(n)]
        hosts = [f"{subnet}.{i + 1}" for i in range(n)]
        state_dir = os.path.join(STATE_ROOT, tag)
        launch = os.path.join(state_dir, "launch")
        # record what will exist before it does, so that a failure half-way is cleaned up
        self.state = ClusterState(tag, hosts, namespaces, bridge, bridge_ip, veths, self.rate_bps, self.latency_s,
                                  self.dilate, os.getpid(), state_dir, launch,
                                  ["-launcher", "ssh", "-launcher-exec", launch, "-localhost", bridge_ip],
                                  dict(RANK_ENV))
        os.makedirs(state_dir, exist_ok=True)
        self._write_state()
        _run(["ip", "link", "add", bridge, "type", "bridge"])
        _run(["ip", "addr", "add", f"{bridge_ip}/24", "dev", bridge])
        _run(["ip", "link", "set", bridge, "up"])
        for ns, veth, ip in zip(namespaces, veths, hosts):
            _run(["ip", "netns", "add", ns])
            _run(["ip", "link", "add", veth, "type", "veth", "peer", "name", HOST_IFACE, "netns", ns])
            _run(["ip", "link", "set", veth, "master", bridge, "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", HOST_IFACE])
            _run(["ip", "-n", ns, "link", "set", HOST_IFACE, "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            _run(["ip", "-n", ns, "route", "add", "default", "via", bridge_ip])
            self._shape(["ip", "netns", "exec", ns], HOST_IFACE)  # what the host sends
            self._shape([], veth)  # what it receives
        self._name_files(namespaces, hosts)
        cases = "\n".join(f"{ip}|h{i}) ns={ns};;" for i, (ip, ns) in enumerate(zip(hosts, namespaces)))
        with open(launch, "w") as f:
            f.write(_LAUNCH % (cases, tag))
        os.chmod(launch, 0o755)

    def _name_files(self, namespaces: List[str], hosts: List[str]) -> None:
        """Per host, /etc/netns/NS/{hosts,resolv.conf} (``ip netns exec`` mounts them over /etc's): the
        hosts resolve h0, h1, ... and this machine's hostname to their own address, and a lookup of
        anything else fails at once instead of waiting for a name server the namespace cannot reach
        (gloo looks up its peers' names)."""
        names = "".join(f"{ip} h{i}\n" for i, ip in enumerate(hosts))
        for ns, ip in zip(namespaces, hosts):
            d = os.path.join(NETNS_ETC, ns)
            os.makedirs(d, exist_ok=True)
            with open(os.path.join(d, "hosts"), "w") as f:
                f.write(f"127.0.0.1 localhost\n{ip} {socket.gethostname()}\n{names}")
            with open(os.path.join(d, "resolv.conf"), "w") as f:
                f.write("# aiacc emulated cluster: no name server\noptions timeout:1 attempts:1\n")

    def _shape(self, prefix: List[str], dev: str) -> None:
        """Token bucket at the rate, and half the one-way latency in a netem queue under it."""
        tc = prefix + ["tc", "qdisc", "add", "dev", dev]
        half = self.latency_s / 2
        delay = ["netem", "delay", f"{half * 1e6:.1f}us", "limit", "100000"]
        if self.rate_bps is not None:
            # the bucket must hold more than one 64 KiB GSO packet (veth passes them whole) or the link
            # stalls; ~2 ms of traffic at high rates so TCP can reach the rate without a long burst
            burst = max(256 * 1024, int(self.rate_bps / 8 * 2e-3))
            _run(tc + ["root", "handle", "1:", "tbf", "rate", f"{int(self.rate_bps)}bit", "burst", str(burst),
                       "latency", "50ms"])
            if half > 0:
                _netem(tc + ["parent", "1:1", "handle", "10:"] + delay)
        elif half > 0:
            _netem(tc + ["root", "handle", "10:"] + delay)

    def _write_state(self) -> None:
        tmp = os.path.join(self.state.state_dir, "cluster.json.tmp")
        with open(tmp, "w") as f:
            json.dump(asdict(self.state), f, indent=1)
        os.replace(tmp, os.path.join(self.state.state_dir, "cluster.json"))

    def _destroy(self) -> None:
        if self.state is not None:
            destroy(self.state)
            self.state = None
        self._restore_signals()

    def _restore_signals(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    # -- use -----------------------------------------------------------------------------------------
    def aiaccrun_command(self, command: Sequence[str], ranks_per_host: int, extra: Sequence[str] = ()) -> List[str]:
        hosts = ",".join(f"h{i}:{ranks_per_host}" for i in range(self.hosts))
        return [sys.executable, "-m", "aiacc.launcher", "--emulated-cluster", self.state.state_dir,
                "-np", str(self.hosts * ranks_per_host), "-H", hosts, *extra, *command]

    def run(self, command: Sequence[str], ranks_per_host: int, extra: Sequence[str] = (),
            env: Optional[Dict[str, str]] = None, on_line: Optional[Callable[[str], None]] = None) -> int:
        """``aiaccrun`` ``command`` on every host, ``ranks_per_host`` ranks each; its exit status. With
        ``on_line``, the job's output (stdout and stderr) goes to it line by line instead."""
        child = dict(os.environ, **(env or {}))
        child.pop("AIACC_ENABLE", None)
        # its own process group, so that a stop reaches aiaccrun and mpiexec even before aiaccrun's
        # signal forwarding is in place
        pipe = subprocess.PIPE if on_line else None
        proc = subprocess.Popen(self.aiaccrun_command(command, ranks_per_host, extra), env=child,
                                start_new_session=True, stdout=pipe, stderr=subprocess.STDOUT if on_line else None,
                                text=bool(on_line))
        try:
            if on_line:
                for line in proc.stdout:
                    on_line(line.rstrip("\n"))
            return proc.wait()
        except BaseException:
            # stopped (SIGTERM, Ctrl-C): end the job before its hosts are removed under it (ranks
            # still inside a host are ended by destroy())
            _signal_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                pass
            _signal_group(proc.pid, signal.SIGKILL)
            proc.wait()
            raise

    def counters(self) -> Dict[str, Tuple[int, int]]:
        """Bytes each host has sent and received over its link so far: {address: (sent, received)}."""
        out = {}
        for ip, veth in zip(self.state.hosts, self.state.veths):
            out[ip] = (_stat(veth, "rx_bytes"), _stat(veth, "tx_bytes"))  # the bridge side sees them reversed
        return out


def _netem(cmd: List[str]) -> None:
    try:
        _run(cmd)
    except ClusterError as exc:
        if "qdisc kind is unknown" in str(exc):
            raise ClusterError("--latency needs the kernel's netem queueing discipline (sch_netem), which this "
                               "kernel does not have; run with --latency 0 (the veth links then add only their "
                               "own few microseconds)") from None
        raise


def _check_privileges() -> None:
    if not sys.platform.startswith("linux"):
        raise ClusterError("the emulated cluster needs Linux network namespaces")
    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    if missing:
        raise ClusterError(f"the emulated cluster needs iproute2's {' and '.join(missing)} (apt-get install iproute2)")
    if not _has_admin_caps():
        raise ClusterError("the emulated cluster creates network namespaces, a bridge and tc-shaped veth links, "
                           "which needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN); run it as root")


def _stat(dev: str, what: str) -> int:
    with open(f"/sys/class/net/{dev}/statistics/{what}") as f:
        return int(f.read())


def _raise_exit(signum, _frame):
    raise SystemExit(128 + signum)  # unwinds through the context manager's cleanup


def _free_subnet() -> str:
    used = set(re.findall(rf"inet {re.escape(SUBNET_PREFIX)}\.(\d+)\.", _run(["ip", "-4", "addr"])))
    for x in range(1, 255):
        if str(x) not in used:
            return f"{SUBNET_PREFIX}.{x}"
    raise ClusterError(f"no free /24 left in {SUBNET_PREFIX}.0.0/16 for an emulated cluster")


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _end_processes_in(namespaces: Sequence[str]) -> None:
    """End whatever still runs inside the hosts (a stopped job's proxies and ranks): TERM, then KILL."""
    def pids():
        out = []
        for ns in namespaces:
            listed = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
            out += [int(p) for p in listed.split() if p.isdigit() and int(p) != os.getpid()]
        return out

    for sig, wait in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 1.0)):
        left = pids()
        if not left:
            return
        for pid in left:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while pids() and time.monotonic() < deadline:
            time.sleep(0.1)


def destroy(state: ClusterState) -> None:
    """End what runs inside the hosts, then remove everything ``state`` names (namespaces take their
    veth ends along)."""
    _end_processes_in(state.namespaces)
    for ns in state.namespaces:
        _quiet(["ip", "netns", "del", ns])
        d = os.path.join(NETNS_ETC, ns)
        for f in ("hosts", "resolv.conf"):
            try:
                os.unlink(os.path.join(d, f))
            except OSError:
                pass
        try:
            os.rmdir(d)
        except OSError:
            pass
    for veth in state.veths:
        _quiet(["ip", "link", "del", veth])
    _quiet(["ip", "link", "del", state.bridge])
    for f in ("launch", "cluster.json", "cluster.json.tmp"):
        try:
            os.unlink(os.path.join(state.state_dir, f))
        except OSError:
            pass
    for d in (state.state_dir, STATE_ROOT, NETNS_ETC):  # the parents only when nothing else is in them
        try:
            os.rmdir(d)
        except OSError:
            pass


def remove_stale() -> List[str]:
    """Remove clusters whose maker has died (``cluster run`` or a context manager killed hard)."""
    removed = []
    for name in _running_names():
        try:
            state = load_state(name)
        except ClusterError:
            continue
        if _stale(state):
            destroy(state)
            removed.append(name)
    return removed


def _stale(state: ClusterState) -> bool:
    """Whether the process that made ``state``'s cluster for itself has died (a cluster made by `cluster up` has
    no owner once made)."""
    return bool(state.owner_pid) and not os.path.exists(f"/proc/{state.owner_pid}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m aiacc.bench cluster", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="action", required=True)

    def shape_args(p):
        p.add_argument("--hosts", type=int, required=True, help="emulated hosts (network namespaces)")
        p.add_argument("--link", default="unlimited", help="each host's link rate: 100mbit, 1gbit, 25gbit, unlimited")
        p.add_argument("--latency", default="0", help="one-way host-to-host latency: 50us, 0.5ms (default 0)")
        p.add_argument("--dilate", type=positive_float, default=1.0, help="divide the rate and multiply the latency by K")

    up = sub.add_parser("up", help="make an emulated cluster that stays until `cluster down`")
    shape_args(up)
    up.add_argument("--name", default="emu", help="its name (1-6 lowercase letters/digits; default emu)")
    down = sub.add_parser("down", help="remove an emulated cluster")
    down.add_argument("--name", default="emu")
    down.add_argument("--all", action="store_true", help="remove every emulated cluster")
    sub.add_parser("status", help="list the emulated clusters that are up")
    run = sub.add_parser("run", help="make a cluster, run COMMAND on it through aiaccrun, remove it")
    shape_args(run)
    run.add_argument("--ranks-per-host", type=positive_int, default=1)
    run.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    try:
        if args.action == "up":
            with EmulatedCluster(args.hosts, args.link, args.latency, args.name, args.dilate, persistent=True) as c:
                s = c.state
                print(f"cluster={s.name} hosts={','.join(s.hosts)} names={','.join(f'h{i}' for i in range(len(s.hosts)))} "
                      f"link_bps={s.rate_bps or 'unlimited'} latency_s={s.latency_s:g} state={s.state_dir}")
                print(f"run: aiaccrun --emulated-cluster {s.name} -np {2 * len(s.hosts)} "
                      f"-H {','.join(f'h{i}:2' for i in range(len(s.hosts)))} python train.py")
            return 0
        if args.action == "down":
            _check_privileges()  # (without them nothing would be removed)
            names = _running_names() if args.all else [args.name]
            for name in names:
                state = load_state(name)
                destroy(state)
                left = [ns for ns in state.namespaces if os.path.exists(os.path.join("/run/netns", ns))]
                if left:
                    raise ClusterError(f"cluster {name!r}: namespaces {', '.join(left)} could not be removed "
                                       "(`ip netns del` failed); remove them by hand")
                print(f"cluster={name} removed")
            return 0
        if args.action == "status":
            names = _running_names()
            if not names:  # (it printed nothing)
                print("no emulated cluster is up; make one with `python -m aiacc.bench cluster up --hosts N`")
            for name in names:
                s = load_state(name)
                stale = " stale (its maker died; the next `up` removes it)" if _stale(s) else ""
                print(f"cluster={s.name} hosts={','.join(s.hosts)} link_bps={s.rate_bps or 'unlimited'} "
                      f"latency_s={s.latency_s:g} owner_pid={s.owner_pid}{stale}")
            return 0
        command = args.command[1:] if args.command[:1] == ["--"] else args.command
        if not command:
            parser.error("cluster run: a COMMAND is required after the options (e.g. -- python train.py)")
        if args.ranks_per_host < 1:
            parser.error("--ranks-per-host must be at least 1")
        with EmulatedCluster(args.hosts, args.link, args.latency, dilate=args.dilate) as c:
            return c.run(command, args.ranks_per_host)
    except ClusterError as exc:
        print(f"aiacc.bench cluster: {exc}", file=sys.stderr)
        return 2

