"""``hvd.elastic`` for MXNet Gluon: a state over a ``ParameterDict`` and a (Distributed)Trainer.

Horovod has no MXNet elastic API; this follows its ``TorchState``: ``MXNetState(params=net.collect_params(),
trainer=trainer, epoch=0)``. ``commit()`` keeps copies of the parameters and of the trainer's optimizer
states (what ``Trainer.save_states`` writes, including the update counts), ``restore()`` puts them back,
``sync()`` gives every rank rank 0's. Under ``aiaccrun --max-restarts N --elastic-dir DIR`` commits also go to
DIR and a restarted job resumes from the last one (see :mod:`aiacc.elastic`).
"""

from __future__ import annotations

import mxnet as mx

from aiacc import broadcast_object
from aiacc.elastic import ElasticStateError, ObjectState, State, restart_count, run
from aiacc.exceptions import HostsUpdatedInterrupt

from .optimizer import broadcast_parameters

__all__ = ["State", "ObjectState", "MXNetState", "run", "restart_count", "ElasticStateError",
           "HostsUpdatedInterrupt"]


def _data(name: str, param):
    """``param.data()``; for a parameter whose initialisation is still deferred (its shape comes with the first
    forward) an error that names it and says what to do, not MXNet's DeferredInitializationError."""
    try:
        return param.data()
    except mx.gluon.parameter.DeferredInitializationError:
        raise ElasticStateError(
            f"MXNetState: parameter {name!r} is not initialised yet (deferred initialisation: its shape is known "
            "after the first forward); run one forward pass, or give the layers their input sizes (in_units=, "
            "in_channels=), before making the state") from None


class MXNetState(ObjectState):
    """The state of ``params`` (a Gluon ``ParameterDict``), of ``trainer``'s optimizer (either may be None) and
    of the keyword arguments, exposed as attributes."""

    def __init__(self, params=None, trainer=None, **kwargs):
        self.params = params
        self.trainer = trainer
        self._save_mx()
        super().__init__(bcast_object=broadcast_object, **kwargs)

    def _save_mx(self):
        self._saved_params = ({k: _data(k, p).copy() for k, p in sorted(self.params.items())}
                              if self.params is not None else None)
        self._saved_trainer = self._trainer_states()

    def _trainer_states(self):
        trainer = self.trainer
        if trainer is None or not getattr(trainer, "_updaters", None):
            return None
        return trainer._updaters[0].get_states(dump_optimizer=True)

    def _set_trainer_states(self, states):
        trainer = self.trainer
        if trainer is None or states is None:
            return
        if not trainer._kv_initialized:
            trainer._init_kvstore()
        for updater in trainer._updaters:
            updater.set_states(states)
            updater.optimizer = trainer._updaters[0].optimizer
        trainer._optimizer = trainer._updaters[0].optimizer
        trainer._optimizer.param_dict = {i: param for i, param in enumerate(trainer._params)}

    def save(self):
        self._save_mx()
        super().save()

    def restore(self):
        if self.params is not None:
            for k, p in self.params.items():
                p.set_data(self._saved_params[k])
        self._set_trainer_states(self._saved_trainer)
        super().restore()

    def sync(self):
        if self.params is not None:
            broadcast_parameters(self.params, root_rank=0)
        self._set_trainer_states(broadcast_object(self._trainer_states(), root_rank=0, name="MXNetState.trainer"))
        self._save_mx()
        super().sync()

    def _framework_payload(self):
        params, trainer = self._saved_params, self._saved_trainer  # new objects at every save()
        return lambda: {"params": {k: v.asnumpy() for k, v in (params or {}).items()}, "trainer": trainer,
                        "has_params": params is not None}

    def _load_persisted(self, payload: dict) -> None:
        self._saved_params = ({k: mx.nd.array(v, dtype=v.dtype) for k, v in payload["params"].items()}
                              if payload["has_params"] else None)
        self._saved_trainer = payload["trainer"]
        super()._load_persisted(payload)

    def _layout(self) -> str:
        parts = [super()._layout()]
        if self.params is not None:
            parts.append(";".join(f"{k}{tuple(p.shape)}" for k, p in sorted(self.params.items())))
        return "|".join(parts)
