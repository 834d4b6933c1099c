"""``hvd.elastic`` for PyTorch: Horovod's ``TorchState`` over a model and an optimizer.

``commit()`` keeps a copy of the model's and the optimizer's state dicts (and of the keyword attributes),
``restore()`` loads them back, ``sync()`` gives every rank rank 0's (``broadcast_parameters`` and
``broadcast_optimizer_state``). Under ``aiaccrun --max-restarts N --elastic-dir DIR`` the commits also go to
DIR and a restarted job resumes from the last one (see :mod:`aiacc.elastic`)::

    state = hvd.elastic.TorchState(model=model, optimizer=opt, epoch=0, batch=0)

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            ...
            state.commit()
"""

from __future__ import annotations

import copy

import torch

from aiacc.elastic import ElasticStateError, ObjectState, State, restart_count, run

from .functions import broadcast_object, broadcast_optimizer_state, broadcast_parameters

__all__ = ["State", "ObjectState", "TorchState", "run", "restart_count", "ElasticStateError"]


def _copy_state(state_dict):
    """A copy of a state dict whose tensors no later training step changes."""
    return {k: (v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)) for k, v in state_dict.items()}


class TorchState(ObjectState):
    """The state of ``model`` and ``optimizer`` (either may be None) and of the keyword arguments, exposed as
    attributes (``state.epoch``)."""

    def __init__(self, model=None, optimizer=None, **kwargs):
        self.model = model
        self.optimizer = optimizer
        self._save_torch()
        super().__init__(bcast_object=broadcast_object, **kwargs)

    def _save_torch(self):
        self._saved_model = _copy_state(self.model.state_dict()) if self.model is not None else None
        self._saved_optimizer = copy.deepcopy(self.optimizer.state_dict()) if self.optimizer is not None else None

    def save(self):
        self._save_torch()
        super().save()

    def restore(self):
        if self.model is not None:
            self.model.load_state_dict(self._saved_model)
        if self.optimizer is not None:
            self.optimizer.load_state_dict(self._saved_optimizer)
        super().restore()

    def sync(self):
        if self.model is not None:
            broadcast_parameters(self.model.state_dict(), root_rank=0)
        if self.optimizer is not None:
            broadcast_optimizer_state(self.optimizer, root_rank=0)
        self._save_torch()
        super().sync()

    def _persisted(self) -> dict:
        return {"model": self._saved_model, "optimizer": self._saved_optimizer, **super()._persisted()}

    def _load_persisted(self, payload: dict) -> None:
        self._saved_model, self._saved_optimizer = payload["model"], payload["optimizer"]
        super()._load_persisted(payload)

    def _layout(self) -> str:
        parts = [super()._layout()]
        if self.model is not None:
            parts.append(";".join(f"{k}{tuple(v.shape)}" for k, v in self.model.state_dict().items()))
        if self.optimizer is not None:
            parts.append(type(self.optimizer).__name__)
        return "|".join(parts)
