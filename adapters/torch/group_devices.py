"""What torch's Python asks of a process group beyond its collectives, for aiacc's ``torch.distributed`` backend
(``backend.py``): the devices it serves and its backend per device.

torch uses a backend's ``ProcessGroup`` subclass as the group itself (it registers no per-device backends on it),
so the base class's ``_device_types`` was empty and ``_get_backend(device)`` raised. Code that asks them failed on
the ``aiacc`` backend where it works over gloo: ``dcp.async_save`` refused ("A CPU backend must be enabled"),
``set_model_state_dict(..., StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))`` raised IndexError,
``dcp`` and FSDP helpers that ask ``_get_pg_default_device`` raised "Default device not found".
"""

from __future__ import annotations

import torch
import torch.distributed.distributed_c10d as c10d

__all__ = ["GroupDevices"]


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
