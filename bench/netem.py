"""An emulated cluster link on one machine: a network namespace whose loopback is capped.

``python -m aiacc.bench --link 1gbit SUBCOMMAND ...`` creates a namespace,
caps its loopback with ``tc`` (token bucket filter), forces MPI onto TCP
(no shared memory: ``MPIR_CVAR_NOLOCAL=1 MPIR_CVAR_CH4_NETMOD=ofi
FI_PROVIDER=tcp``), runs ``aiaccrun -np N python -m aiacc.bench SUBCOMMAND
...`` inside it, and removes the namespace afterwards. Every byte between
ranks then crosses the capped link, MPI's and gloo's alike (the DDP baseline
connects to 127.0.0.1 inside the same namespace).

``--link unlimited`` gives the same namespace and TCP transport without a
cap. Creating a namespace needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) and
iproute2's ``ip`` and ``tc``; without them this module says so and stops.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from typing import List, Optional, Sequence

__all__ = ["parse_rate", "LinkError", "run_on_link", "TCP_ENV"]

TCP_ENV = {"MPIR_CVAR_NOLOCAL": "1", "MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp"}
_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}


class LinkError(Exception):
    """The emulated link cannot be set up here; the message says why."""


def parse_rate(text: str) -> Optional[float]:
    """``"1gbit"`` -> 1e9 bits/s; ``"unlimited"`` -> None."""
    t = text.strip().lower()
    if t in ("unlimited", "none", "inf"):
        return None
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([kmgt]?bit)", t)
    if not m or float(m.group(1)) <= 0:
        raise LinkError(f"--link {text!r}: expected a rate > 0 such as 100mbit, 1gbit, 10gbit, or 'unlimited'")
    return float(m.group(1)) * _UNITS[m.group(2)]


def _run(cmd: List[str]) -> None:
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise LinkError(f"`{' '.join(cmd)}` failed: {(out.stderr or out.stdout).strip()}")


CAP_NET_ADMIN, CAP_SYS_ADMIN = 12, 21


def _has_admin_caps() -> bool:
    """Whether this process may create namespaces and configure tc (its effective capabilities)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    eff = int(line.split()[1], 16)
                    return bool(eff >> CAP_NET_ADMIN & 1 and eff >> CAP_SYS_ADMIN & 1)
    except OSError:
        pass
    return os.geteuid() == 0


def _check_tools() -> None:
    if os.name != "posix" or not sys.platform.startswith("linux"):
        raise LinkError("--link needs Linux network namespaces")
    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    if missing:
        raise LinkError(f"--link needs iproute2's {' and '.join(missing)} (apt-get install iproute2)")
    if not _has_admin_caps():
        raise LinkError("--link creates a network namespace and caps its loopback with tc, which needs root "
                        "(CAP_NET_ADMIN and CAP_SYS_ADMIN); run it as root or without --link")


def run_on_link(rate_text: str, np: int, bench_argv: Sequence[str]) -> int:
    """Run ``aiaccrun -np np python -m aiacc.bench *bench_argv`` on an emulated link; return its status."""
    rate = parse_rate(rate_text)
    _check_tools()
    _remove_stale_namespaces()
    ns = f"aiacc-bench-{os.getpid()}"
    _run(["ip", "netns", "add", ns])
    previous = {sig: signal.signal(sig, _raise_exit) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        _run(["ip", "-n", ns, "link", "set", "lo", "up"])
        if rate is not None:
            # Token bucket at the rate. Its bucket must hold more than one packet of loopback's 64 KiB MTU
            # (a smaller one never lets a full packet through: the link silently stalls), and ~10 ms of
            # traffic so TCP can reach the rate.
            burst = max(256 * 1024, int(rate / 8 / 100))
            _run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "lo", "root", "tbf",
                  "rate", f"{int(rate)}bit", "burst", str(burst), "latency", "100ms"])
        env = dict(os.environ)
        env.update(TCP_ENV)
        env.pop("AIACC_ENABLE", None)
        cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "aiacc.launcher", "-np", str(np),
               sys.executable, "-m", "aiacc.bench", *bench_argv]
        return subprocess.call(cmd, env=env)
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _raise_exit(signum, _frame):
    raise SystemExit(128 + signum)  # unwinds through run_on_link's cleanup


def _remove_stale_namespaces() -> None:
    """Namespaces left by benchmarks that were killed (their process is gone)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        name = line.split()[0] if line.strip() else ""
        if name.startswith("aiacc-bench-"):
            pid = name.rsplit("-", 1)[1]
            if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
                subprocess.run(["ip", "netns", "del", name], capture_output=True)
