"""``hvd.elastic`` for TensorFlow: Horovod's state objects over TensorFlow variables and Keras models.

``commit()`` keeps a copy of the state in memory, ``restore()`` returns to it, ``sync()`` gives every rank
rank 0's values (variables by ``broadcast_variables``, the keyword attributes by ``broadcast_object``).
Under ``aiaccrun --max-restarts N --elastic-dir DIR`` commits also go to DIR and a restarted job resumes
from the last one (see :mod:`aiacc.elastic`); within one start the ranks never change.
"""

from __future__ import annotations

import tensorflow as tf

from aiacc.elastic import ElasticStateError, ObjectState, State, restart_count, run
from aiacc.exceptions import HostsUpdatedInterrupt

from .functions import broadcast_object, broadcast_variables, model_variables

__all__ = ["State", "ObjectState", "TensorFlowState", "TensorFlowKerasState", "run", "restart_count",
           "ElasticStateError", "HostsUpdatedInterrupt"]


def _arrays(values):
    """numpy copies of saved values (what a commit file holds)."""
    return [v.numpy() for v in values]


def _shapes(variables) -> str:
    return ";".join(f"{tuple(v.shape)}" for v in variables)


def _values(variables):
    """Copies of the variables' current values (eager tensors)."""
    if not tf.executing_eagerly():  # (inside a tf.function the copies would be graph tensors, traced once)
        raise ElasticStateError("an elastic state is committed, synced or made eagerly, not inside a tf.function "
                                "(there it would run once, while traced, and keep graph tensors): call "
                                "state.commit() between the calls of the tf.function that trains")
    return [tf.identity(tf.convert_to_tensor(v)) for v in variables]


class TensorFlowState(ObjectState):
    """State of a list of variables (default: ``tf.compat.v1.global_variables()``) and of the keyword
    arguments, exposed as attributes. Eager execution (TensorFlow 2); ``session`` is accepted for Horovod
    compatibility."""

    def __init__(self, variables=None, session=None, **kwargs):
        self.variables = list(variables) if variables is not None else tf.compat.v1.global_variables()
        if variables is None and not self.variables and tf.executing_eagerly():
            # (Horovod's default too: the state held nothing, and a restart resumed with untrained weights)
            raise ElasticStateError(
                "TensorFlowState() without variables= holds tf.compat.v1.global_variables(), which is empty in eager "
                "mode (TensorFlow 2): pass variables=model.variables + optimizer.variables (of a built optimizer: "
                "optimizer.build(model.trainable_variables)), or use TensorFlowKerasState(model, optimizer)")
        self.session = session
        self._saved_values = _values(self.variables)
        super().__init__(bcast_object=broadcast_object, **kwargs)

    def save(self):
        self._saved_values = _values(self.variables)
        super().save()

    def restore(self):
        for v, value in zip(self.variables, self._saved_values):
            v.assign(value)
        super().restore()

    def sync(self):
        broadcast_variables(self.variables, root_rank=0, name="TensorFlowState.sync")
        self._saved_values = _values(self.variables)
        super().sync()

    # a commit file (aiaccrun --elastic-dir) holds the variables' values as numpy arrays
    def _framework_payload(self):
        saved = self._saved_values  # a new list at every save()
        return lambda: {"variables": _arrays(saved)}

    def _load_persisted(self, payload: dict) -> None:
        self._saved_values = [tf.constant(a) for a in payload["variables"]]
        super()._load_persisted(payload)

    def _layout(self) -> str:
        return super()._layout() + "|" + _shapes(self.variables)


def _optimizer_variables(optimizer):
    if optimizer is None:
        return []
    variables = optimizer.variables
    return list(variables() if callable(variables) else variables)  # a method in Keras 2, a list in Keras 3


def _current(model) -> None:
    """Make ``model``'s variables hold its current values. Keras' JAX trainer keeps them apart while ``fit``
    runs (the variables are emptied; its own state moves on) until ``jax_state_sync()`` writes them back, which
    also makes the next step read the variables again (so a ``restore()`` there takes effect)."""
    sync = getattr(model, "jax_state_sync", None)
    if callable(sync):
        sync()


class TensorFlowKerasState(ObjectState):
    """State of a built Keras model, its optimizer (``optimizer`` or the model's) and of the keyword
    arguments, exposed as attributes. ``backend`` is accepted for Horovod compatibility.

    A Keras 3 optimizer that is not built yet (``model.compile`` leaves it so until ``fit`` starts) is built
    here over the model's trainable variables: its slots (Adam's moments, momentum) then exist from the first
    commit on, so every commit holds them and a resume restores them (Horovod asks for one ``fit`` step first).
    Without ``optimizer``, the model's is looked up at each commit, restore and sync (a state made before
    ``model.compile`` tracked none: its commits left the optimizer's moments out)."""

    def __init__(self, model, optimizer=None, backend=None, **kwargs):
        if hasattr(model, "build") and not model.built:
            raise ValueError("Model must be built first. Run `model.build(input_shape)`.")
        self.model = model
        self._optimizer = optimizer
        self.backend = backend
        self._save_model()
        super().__init__(bcast_object=broadcast_object, **kwargs)

    @property
    def optimizer(self):
        """``optimizer`` as given, or the model's (``model.compile`` may come after the state is made), built."""
        opt = self._optimizer if self._optimizer is not None else getattr(self.model, "optimizer", None)
        # built before ``fit`` (a commit then has the slots a restart's commits have): Keras 3's ``built``, tf_keras'
        # ``_built``, set by its build() (Keras 2 has no ``built``: it was not built, and a restart's commit had fewer
        # variables than the first start's: "holds commits of another job"), a legacy optimizer's slots
        built = getattr(opt, "built", getattr(opt, "_built", False if hasattr(opt, "build") else None))
        if built is False:
            opt.build(self.model.trainable_variables)
        elif built is None and hasattr(opt, "_create_all_weights") and not getattr(opt, "_slots", True):
            opt._create_all_weights(self.model.trainable_variables)
        return opt

    @optimizer.setter
    def optimizer(self, value):
        self._optimizer = value

    def save(self):
        self._save_model()
        super().save()

    def restore(self):
        _current(self.model)
        for v, value in zip(self.model.variables, self._saved_model):
            v.assign(value)
        for v, value in zip(_optimizer_variables(self.optimizer), self._saved_optimizer):
            v.assign(value)
        super().restore()

    def sync(self):
        _current(self.model)
        broadcast_variables(model_variables(self.model), root_rank=0, name="TensorFlowKerasState.model")
        broadcast_variables(_optimizer_variables(self.optimizer), root_rank=0, name="TensorFlowKerasState.optimizer")
        self._save_model()
        super().sync()

    def _save_model(self):
        _current(self.model)
        self._saved_model = _values(self.model.variables)
        self._saved_optimizer = _values(_optimizer_variables(self.optimizer))

    def _framework_payload(self):
        model, optimizer = self._saved_model, self._saved_optimizer  # new lists at every save()
        return lambda: {"model": _arrays(model), "optimizer": _arrays(optimizer)}

    def _load_persisted(self, payload: dict) -> None:
        for what, variables in (("model", self.model.variables), ("optimizer", _optimizer_variables(self.optimizer))):
            if len(payload[what]) != len(variables):  # the fingerprint's layout makes this rare; never drop values
                raise ElasticStateError(f"the commit holds {len(payload[what])} {what} variables, this "
                                        f"{type(self).__name__} has {len(variables)}")
        self._saved_model = [tf.constant(a) for a in payload["model"]]
        self._saved_optimizer = [tf.constant(a) for a in payload["optimizer"]]
        super()._load_persisted(payload)

    def _layout(self) -> str:
        return (super()._layout() + "|" + _shapes(self.model.variables) + "|optimizer:"
                + _shapes(_optimizer_variables(self.optimizer)))
