"""What torch's Python asks of a process group beyond its collectives, for aiacc's ``torch.distributed`` backend
(``backend.py``): the devices it serves, its backend per device, and ``dist.monitored_barrier``.

torch uses a backend's ``ProcessGroup`` subclass as the group itself (it registers no per-device backends on it),
so the base class's ``_device_types`` was empty and ``_get_backend(device)`` raised. Code that asks them failed on
the ``aiacc`` backend where it works over gloo: ``dcp.async_save`` refused ("A CPU backend must be enabled"),
``set_model_state_dict(..., StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))`` raised IndexError,
``dcp`` and FSDP helpers that ask ``_get_pg_default_device`` raised "Default device not found".

``dist.monitored_barrier`` refuses every backend but gloo by its name, before it calls the group
(``group.monitored_barrier(timeout, wait_all_ranks=...)``): ``install_monitored_barrier`` lets groups of the
``aiacc`` backend through to their own (other groups go to torch's function as they are).
"""

from __future__ import annotations

import functools
import time

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

import aiacc
from aiacc.ops import Collective

from .works import seconds_of

__all__ = ["GroupDevices", "install_monitored_barrier"]


class GroupDevices:
    """Mixed into ``AiaccProcessGroup`` (before ``dist.ProcessGroup``, whose C++ properties these shadow for torch's
    Python)."""

    # what torch's Python reads of a backend that ``_get_backend`` returns (this group is its own backend): the NCCL
    # features it has not
    supports_splitting = False
    supports_coalescing = False
    supports_time_estimate = False

    @property
    def _device_types(self):
        """The devices of the group's backend configuration (``init_process_group("aiacc")``: cpu and cuda, as
        over gloo; ``"cpu:aiacc"``: cpu alone)."""
        config = c10d._world.pg_backend_config.get(self, "") or "cpu:aiacc,cuda:aiacc"
        devices = [part.split(":")[0] for part in config.split(",") if ":" in part]
        return [torch.device(d) for d in devices] or [torch.device("cpu"), torch.device("cuda")]

    def _get_backend(self, device):
        """The backend for ``device``: this group itself, for the devices it serves (as the base class raises for
        others)."""
        device = torch.device(device)
        if any(d.type == device.type for d in self._device_types):
            return self
        raise RuntimeError(f"No backend type associated with device type {device.type}")

    def monitored_barrier(self, timeout=None, wait_all_ranks: bool = False) -> None:
        """``dist.monitored_barrier`` as over gloo: a barrier that, past ``timeout`` (a ``timedelta``; none: the
        group's), raises RuntimeError naming the rank (``wait_all_ranks=True``: every rank) of the group that has
        not reached it, on every rank that has. The engine's barrier, whose stall report names those ranks."""
        self._check_usable("monitored_barrier")
        seconds = seconds_of(timeout) or self._timeout
        core = aiacc.submit(Collective.BARRIER, [], name=None, process_set=self._set)
        try:
            core.wait(None, time.perf_counter() + seconds)
            return
        except TimeoutError:
            pass
        found = aiacc.api.missing_ranks(core.name, self._set, wait=5.0)  # (it answers once the ranks have)
        if core.done():  # (it ended just now)
            core.wait()
            return
        ranks = self._ranks if self._ranks is not None else list(range(self.size()))
        missing = [ranks.index(k) for k in found[1] if k in ranks] if found else []
        if not wait_all_ranks:
            missing = missing[:1]
        who = (f"Rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))}" if missing
               else "A rank (which one is unknown: no answer from the other ranks' engines)")
        raise RuntimeError(f"aiacc backend: [Rank {self.rank()}]: {who} failed to pass monitoredBarrier in "
                           f"{round(seconds * 1000)} ms (monitored_barrier on {self._describe()}); the barrier "
                           "still waits for it")


def install_monitored_barrier() -> None:
    """Route ``dist.monitored_barrier`` on groups of the ``aiacc`` backend to the group's ``monitored_barrier``
    (torch's function refuses every backend but gloo by name: "only implemented for GLOO backend"); it stays
    torch's own for other groups."""
    original = c10d.monitored_barrier
    if getattr(original, "_aiacc", False):
        return

    @functools.wraps(original)
    def monitored_barrier(group=None, timeout=None, wait_all_ranks=False):
        if not c10d._rank_not_in_group(group) and dist.get_backend(group) == "aiacc":
            return (group or c10d._get_default_group()).monitored_barrier(timeout, wait_all_ranks=wait_all_ranks)
        return original(group, timeout, wait_all_ranks)

    monitored_barrier._aiacc = True
    c10d.monitored_barrier = dist.monitored_barrier = monitored_barrier
