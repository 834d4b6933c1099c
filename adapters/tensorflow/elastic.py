"""``hvd.elastic`` for TensorFlow: Horovod's state objects over TensorFlow variables and Keras models.

``commit()`` keeps a copy of the state in memory, ``restore()`` returns to it, ``sync()`` gives every rank
rank 0's values (variables by ``broadcast_variables``, the keyword attributes by ``broadcast_object``).
An aiacc job keeps the ranks it started with: ``run`` calls the function once after ``state.sync()`` and
nothing is resized or retried (see :mod:`aiacc.elastic`).
"""

from __future__ import annotations

import tensorflow as tf

from aiacc.elastic import ObjectState, State, run

from .functions import broadcast_object, broadcast_variables

__all__ = ["State", "ObjectState", "TensorFlowState", "TensorFlowKerasState", "run"]


def _values(variables):
    """Copies of the variables' current values (eager tensors)."""
    return [tf.identity(tf.convert_to_tensor(v)) for v in variables]


class TensorFlowState(ObjectState):
    """State of a list of variables (default: ``tf.compat.v1.global_variables()``) and of the keyword
    arguments, exposed as attributes. Eager execution (TensorFlow 2); ``session`` is accepted for Horovod
    compatibility."""

    def __init__(self, variables=None, session=None, **kwargs):
        self.variables = list(variables) if variables is not None else tf.compat.v1.global_variables()
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


def _optimizer_variables(optimizer):
    if optimizer is None:
        return []
    variables = optimizer.variables
    return list(variables() if callable(variables) else variables)  # a method in Keras 2, a list in Keras 3


class TensorFlowKerasState(ObjectState):
    """State of a built Keras model, its optimizer (``optimizer`` or the model's) and of the keyword
    arguments, exposed as attributes. ``backend`` is accepted for Horovod compatibility."""

    def __init__(self, model, optimizer=None, backend=None, **kwargs):
        if hasattr(model, "build") and not model.built:
            raise ValueError("Model must be built first. Run `model.build(input_shape)`.")
        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        self.backend = backend
        self._save_model()
        super().__init__(bcast_object=broadcast_object, **kwargs)

    def save(self):
        self._save_model()
        super().save()

    def restore(self):
        for v, value in zip(self.model.variables, self._saved_model):
            v.assign(value)
        for v, value in zip(_optimizer_variables(self.optimizer), self._saved_optimizer):
            v.assign(value)
        super().restore()

    def sync(self):
        broadcast_variables(self.model.variables, root_rank=0, name="TensorFlowKerasState.model")
        broadcast_variables(_optimizer_variables(self.optimizer), root_rank=0, name="TensorFlowKerasState.optimizer")
        self._save_model()
        super().sync()

    def _save_model(self):
        self._saved_model = _values(self.model.variables)
        self._saved_optimizer = _values(_optimizer_variables(self.optimizer))
