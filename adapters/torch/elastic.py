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
import threading

import torch

from aiacc.elastic import ElasticStateError, ObjectState, State, restart_count, run

from .functions import broadcast_object, broadcast_optimizer_state, broadcast_parameters

__all__ = ["State", "ObjectState", "TorchState", "run", "restart_count", "ElasticStateError"]


def _copy_value(v):
    """A copy no later training step changes."""
    return v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)


class TorchState(ObjectState):
    """The state of ``model`` and ``optimizer`` (either may be None) and of the keyword arguments, exposed as
    attributes (``state.epoch``).

    ``commit()`` returns after copying the model's buffers (forward changes those: BatchNorm statistics);
    the parameters and the optimizer's state, which only ``optimizer.step()`` changes, are copied by a
    background thread while the next forward and backward run, and ``step()`` waits for that copy first (a
    step pre-hook). Change parameters elsewhere between a commit and the next step and the copy may see the
    change: call ``state.save()`` again after such code, or update through the optimizer."""

    def __init__(self, model=None, optimizer=None, **kwargs):
        self.model = model
        self.optimizer = optimizer
        self._copying = None  # (thread, box) of a copy still running
        self._hooked = False
        self._save_torch(background=False)
        super().__init__(bcast_object=broadcast_object, **kwargs)

    def _save_torch(self, background: bool = True):
        self._wait_copy()
        model, optimizer = self.model, self.optimizer
        box = {"model": None, "optimizer": None, "error": None}
        params = {}
        if model is not None:
            ids = {id(p) for p in model.parameters()}
            live = model.state_dict(keep_vars=True)
            params = {k: v for k, v in live.items() if id(v) in ids}
            box["model"] = {k: _copy_value(v) for k, v in live.items() if k not in params}  # buffers: now
            box["order"] = list(live)
        # the optimizer's state dict is taken here (its structure follows param_groups, which an optimizer
        # wrapper may rearrange while it works); the thread copies the tensors it refers to
        optimizer_state = optimizer.state_dict() if optimizer is not None else None

        def copy_rest():
            try:
                if params:
                    with torch.no_grad():
                        box["model"].update((k, v.detach().clone()) for k, v in params.items())
                    box["model"] = {k: box["model"][k] for k in box["order"]}
                if optimizer_state is not None:
                    box["optimizer"] = copy.deepcopy(optimizer_state)
            except BaseException as exc:  # noqa: BLE001 - raised where the copy is waited for
                box["error"] = exc
            finally:
                box["done"].set()

        box["done"] = threading.Event()
        if background and optimizer is not None and params:
            if not self._hooked:  # the only code that changes parameters: it waits for the copy
                optimizer.register_step_pre_hook(lambda *_: self._wait_copy())
                self._hooked = True
            thread = threading.Thread(target=copy_rest, name="aiacc-elastic-copy", daemon=True)
            self._copying = (thread, box)
            thread.start()
        else:
            copy_rest()
            self._take(box)

    def _take(self, box):
        if box["error"] is not None:
            raise ElasticStateError(f"TorchState: copying the state failed: {box['error']}") from box["error"]
        self._saved_model, self._saved_optimizer = box["model"], box["optimizer"]
        self._box = box

    def _wait_copy(self):
        copying, self._copying = self._copying, None
        if copying is not None:
            thread, box = copying
            thread.join()
            self._take(box)

    def save(self):
        self._save_torch()
        super().save()

    def restore(self):
        self._wait_copy()
        if self.model is not None:
            self.model.load_state_dict(self._saved_model)
        if self.optimizer is not None:
            self.optimizer.load_state_dict(self._saved_optimizer)
        super().restore()

    def sync(self):
        self._wait_copy()
        if self.model is not None:
            broadcast_parameters(self.model.state_dict(), root_rank=0)
        if self.optimizer is not None:
            broadcast_optimizer_state(self.optimizer, root_rank=0)
        self._save_torch(background=False)
        super().sync()

    def _framework_payload(self):
        box = self._copying[1] if self._copying is not None else self._box

        def payload():
            box["done"].wait()  # on the writer's thread: the copy of this commit is complete
            return {"model": box["model"], "optimizer": box["optimizer"]}
        return payload

    def _load_persisted(self, payload: dict) -> None:
        self._wait_copy()
        self._saved_model, self._saved_optimizer = payload["model"], payload["optimizer"]
        super()._load_persisted(payload)

    def _layout(self) -> str:
        parts = [super()._layout()]
        if self.model is not None:
            parts.append(";".join(f"{k}{tuple(v.shape)}" for k, v in self.model.state_dict().items()))
        if self.optimizer is not None:
            parts.append(type(self.optimizer).__name__)
        return "|".join(parts)
