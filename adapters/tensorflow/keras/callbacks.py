"""Horovod's Keras callbacks for Keras 3 (and Keras 2's ``fit``): broadcast at start, averaged metrics, learning-rate
warmup and schedule, the best model's checkpoint."""

from __future__ import annotations

import logging
import numbers
import weakref

import keras
import numpy as np

import aiacc

from .._same_start import exempt
from ..functions import broadcast_variables, model_variables

logger = logging.getLogger(__name__)

__all__ = ["BroadcastGlobalVariablesCallback", "MetricAverageCallback", "LearningRateWarmupCallback",
           "LearningRateScheduleCallback", "BestModelCheckpoint"]


class _Callback(keras.callbacks.Callback):
    """Keras 3's callback that Keras 2's ``model.fit`` (``tf.keras`` with ``TF_USE_LEGACY_KERAS=1``) can call too: its
    callback list asks each callback which batch hooks it implements, and whether it takes tensors as logs."""

    _supports_tf_logs = False  # (Keras 2 hands numpy logs)
    _chief_worker_only = None

    def _implements(self, *hooks) -> bool:
        return any(getattr(type(self), h) is not getattr(keras.callbacks.Callback, h) for h in hooks)

    def _implements_train_batch_hooks(self) -> bool:
        return self._implements("on_batch_begin", "on_batch_end", "on_train_batch_begin", "on_train_batch_end")

    def _implements_test_batch_hooks(self) -> bool:
        return self._implements("on_test_batch_begin", "on_test_batch_end")

    def _implements_predict_batch_hooks(self) -> bool:
        return self._implements("on_predict_batch_begin", "on_predict_batch_end")


def _optimizer_variables(opt, trainable_variables) -> list:
    """The optimizer's variables, made first if it has not made them yet (Keras 3's ``build``; Keras 2's
    ``build`` or, for ``tf.keras.optimizers.legacy``, ``_create_all_weights``)."""
    if isinstance(opt, keras.optimizers.Optimizer):
        if not opt.built:
            opt.build(trainable_variables)
        return list(opt.variables)
    if hasattr(opt, "_create_all_weights"):  # Keras 2's legacy optimizers: slots made at the first update otherwise
        opt._create_all_weights(trainable_variables)
        return list(opt.variables())
    opt.build(trainable_variables)  # (Keras 2's: made once)
    return list(opt.variables)


class BroadcastGlobalVariablesCallback(_Callback):
    """Make every rank start from ``root_rank``'s model and optimizer state.

    When training begins, broadcasts ``model.variables`` (weights, non-trainable state; not Keras 3's seed
    generators: each rank keeps its own dropout masks, as one process draws one per row) and the optimizer's
    variables (building the optimizer first if Keras has not yet, so that the first step already starts from the
    same state everywhere). A model that Keras builds in its first step (a ``Sequential`` without an ``Input``, a
    subclassed model) has no variables then: they are broadcast after the first batch, as Horovod's callback does.
    Runs once per callback object. ``local_variables``: variables of the model that keep each rank's own value (a list, or one variable, as
    in Horovod); ``register_local_var(var)`` adds one. ``device`` is accepted for Horovod compatibility.
    """

    def __init__(self, root_rank: int = 0, device: str = "", local_variables=None):
        super().__init__()
        self.root_rank = int(root_rank)
        if local_variables is None:
            local_variables = []
        elif hasattr(local_variables, "assign"):  # one variable (truth-testing a Keras variable raises)
            local_variables = [local_variables]
        self.local_variables = list(local_variables)
        self.broadcast_done = False

    def register_local_var(self, var) -> None:
        """Keep ``var`` out of the broadcast: each rank keeps its own value (Horovod's method)."""
        self.local_variables.append(var)

    def on_train_begin(self, logs=None):
        check_same_steps(self, "BroadcastGlobalVariablesCallback")
        warn_if_not_averaging(self.model)
        if self.broadcast_done:
            return
        if not getattr(self.model, "built", True) or not self.model.variables:
            # a model Keras builds in its first step (no Input, a subclassed model on TensorFlow): nothing to
            # broadcast yet; after the first batch instead, as Horovod's callback always does
            return
        self._broadcast()

    def on_train_batch_end(self, batch, logs=None):
        if not self.broadcast_done:
            self._broadcast()

    def _broadcast(self) -> None:
        local = {id(v) for v in self.local_variables}
        broadcast_variables([v for v in model_variables(self.model) if id(v) not in local], self.root_rank,
                            name="BroadcastGlobalVariablesCallback.model")
        opt = getattr(self.model, "optimizer", None)
        if opt is not None:
            broadcast_variables(_optimizer_variables(opt, self.model.trainable_variables), self.root_rank,
                                name="BroadcastGlobalVariablesCallback.optimizer")
            if self.local_variables:  # (each rank keeps its own: not compared at the second step, _same_start)
                exempt(opt, self.local_variables)
        self.broadcast_done = True


class MetricAverageCallback(_Callback):
    """Replace every number in the epoch's logs by its average over the ranks, so that all ranks log,
    checkpoint and stop early on the same values.

    Put it before callbacks that read the logs (ModelCheckpoint, EarlyStopping, ...). The averages are
    computed in float64 from every rank's values in rank order, so they are bitwise identical everywhere.
    Ranks whose logs hold different keys get an error naming the ranks. ``device`` is accepted for Horovod
    compatibility (the averages are computed on the host).
    """

    def __init__(self, device: str = ""):
        super().__init__()
        self.device = device

    def on_train_begin(self, logs=None):
        check_same_steps(self, "MetricAverageCallback")
        warn_if_not_averaging(self.model)

    def on_epoch_end(self, epoch, logs=None):
        if getattr(self.model, "stop_training", False):
            # a rank that stops in the middle of an epoch (keras.callbacks.TerminateOnNaN on its own batch's loss;
            # the others' go NaN a step later) came here while the others waited in the next step's reduction: a
            # stall for ever (Horovod's too). Joined, it adds zeros to their steps until each stops and joins too;
            # then every rank is here and the averages below are taken
            aiacc.join()
        if logs is None:
            return
        values = {k: _metric_value(v) for k, v in logs.items()}
        keys = sorted(k for k, v in values.items() if v is not None)
        mine = (keys, [values[k] for k in keys])
        everyone = aiacc.allgather_object(mine, name="MetricAverageCallback")
        for r, (their_keys, theirs) in enumerate(everyone):
            if their_keys != keys:
                raise ValueError(f"MetricAverageCallback: rank {aiacc.rank()} logs {keys} but rank {r} logs "
                                 f"{their_keys} at the end of epoch {epoch}; every rank must log the same metrics")
            for k, a, b in zip(keys, mine[1], theirs):
                if np.shape(a) != np.shape(b):
                    raise ValueError(f"MetricAverageCallback: metric {k!r} has shape {np.shape(a)} on rank "
                                     f"{aiacc.rank()} but {np.shape(b)} on rank {r} at the end of epoch {epoch}")
        for i, k in enumerate(keys):
            total = 0.0
            for _, theirs in everyone:
                total = total + theirs[i]
            mean = total / len(everyone)
            logs[k] = float(mean) if np.ndim(mean) == 0 else mean


def check_same_steps(callback, who: str) -> None:
    """``model.fit``'s epochs and steps per epoch (as Keras counts them; unknown for a dataset of unknown length)
    the same on every rank, else a ValueError on every rank naming each rank's. Every step averages gradients across
    ranks: a rank with fewer batches went on to the next epoch's steps or callbacks while the others waited in a
    step's reduction (a stall for ever at the next epoch's end under MetricAverageCallback, as in Horovod)."""
    params = callback.params or {}
    mine = (params.get("epochs"), params.get("steps"))
    everyone = aiacc.allgather_object(mine, name=f"{who}.steps")
    for i, what in enumerate(("epochs", "steps per epoch")):
        known = [theirs[i] for theirs in everyone if theirs[i] is not None]
        if len(set(known)) > 1:
            each = "; ".join(f"rank {k}: {theirs[i]}" for k, theirs in enumerate(everyone))
            raise ValueError(f"{who}: model.fit runs a different number of {what} on different ranks ({each}); "
                             "every step averages the gradients across ranks, so every rank must run the same "
                             "number (shard the data evenly, or pass fit the same steps_per_epoch= on every rank)")


_warned_models: "weakref.WeakSet" = weakref.WeakSet()


def warn_if_not_averaging(model) -> None:
    """A warning (once per model, on each rank where it holds) when ``model.fit`` will not average the gradients:
    the model's optimizer is no ``DistributedOptimizer`` (nor a loss-scale optimizer around one) and its
    ``train_step`` is Keras' own, so nothing in the step calls aiacc. That is what ``keras.models.load_model``
    gives back (the optimizer in the file is restored unwrapped): with the callbacks every rank starts from rank 0's
    weights, then trains on its own shard's gradients alone, and the ranks drift apart without an error. A
    ``train_step`` of the user's own (a ``DistributedGradientTape`` in it) is trusted."""
    if aiacc.size() == 1 or model is None or model in _warned_models:
        return
    opt = getattr(model, "optimizer", None)
    if opt is None or any(hasattr(o, "_aiacc_reducer") for o in (opt, getattr(opt, "inner_optimizer", None))):
        return
    owner = next((k for k in type(model).__mro__ if "train_step" in vars(k)), None)
    if owner is None or not owner.__module__.startswith(("keras.", "tf_keras.")):
        return
    _warned_models.add(model)
    logger.warning(
        f"rank {aiacc.rank()}: model.fit will train {getattr(model, 'name', 'the model')} on this rank's gradients "
        f"alone, not their average over the {aiacc.size()} ranks: its optimizer ({type(opt).__name__}) is not a "
        "DistributedOptimizer (keras.models.load_model restores the optimizer in the file unwrapped) and its "
        "train_step is Keras' own. Compile it with hvd.DistributedOptimizer(optimizer), or load it with "
        "hvd.load_model(path), which wraps the optimizer it restores")


def _metric_value(value):
    """A log entry as float64 (a number) or a float64 array (a metric with several thresholds, a
    per-class metric), to be averaged; None for what is not a number (a string, a bool)."""
    if isinstance(value, bool) or isinstance(value, (str, bytes)):
        return None
    if isinstance(value, numbers.Number):
        return float(value)
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        try:
            array = np.asarray(keras.ops.convert_to_numpy(value))
        except (TypeError, ValueError, NotImplementedError):  # not a tensor Keras knows: left as it is (a failed
            return None  # step's result on JAX raises XLA's error: said, not taken for a value that is no number)
        if array.dtype.kind in "fiu":
            return array.astype(np.float64) if array.ndim else float(array)
    return None


def _steps_per_execution(model) -> int:
    """The train steps per call of ``fit``'s compiled function: Keras 3's ``model.steps_per_execution``, Keras 2's
    ``model._steps_per_execution`` (a variable); 1 where unknown (not compiled, "auto")."""
    steps = getattr(model, "steps_per_execution", None)
    if steps is None:
        steps = getattr(model, "_steps_per_execution", None)
    try:
        return int(np.asarray(steps)) if steps is not None else 1
    except (TypeError, ValueError):
        return 1


# the attribute of a model in which UpdateBatchStateCallback notes the batches of the epoch done before this fit
BATCHES_BEFORE = "_aiacc_batches_before"


class _LearningRateCallback(_Callback):
    """What Horovod's learning-rate callbacks share: the epoch being trained, the steps per epoch (when the
    callback needs them: ``fit``'s count unless given), and ``momentum_correction``, Horovod's: each time the
    callback sets the learning rate (at a batch's start) it multiplies the momentum by ``new_lr / old_lr`` for
    that batch and gives it back at the batch's end. That needs a momentum the train function reads per batch:
    a Keras 2 legacy optimizer's (``tf.keras.optimizers.legacy.SGD``, a hyperparameter variable). Keras 3's and
    Keras 2's ``tf.keras.optimizers`` compile their momentum into the train function as a Python number: a
    warning then says it is not applied.

    With ``compile(steps_per_execution=N)``, N > 1, Keras calls the batch hooks once per call of its train function,
    at batches 0, N, 2N, ... (their real indices: the rate set there is the schedule's at that batch) and the N steps
    of a call share that rate: a callback that sets the rate per batch warns once (rank 0) that it changes once per N
    steps, and how to get it per step."""

    needs_steps = True  # (also: it sets the rate per batch, not only at an epoch's first)

    def __init__(self, momentum_correction, steps_per_epoch):
        super().__init__()
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self._given_steps = steps_per_epoch  # (else each fit's own count: a later fit may have other steps)
        self.current_epoch = 0
        self.restore_momentum = None
        self._momentum_of = None  # the optimizer whose momentum is corrected
        self._warned_steps = False  # (the steps_per_execution warning: once)

    def on_train_begin(self, logs=None):
        name = type(self).__name__
        if self.needs_steps and not self._given_steps:
            self.steps_per_epoch = (self.params or {}).get("steps")
            if not self.steps_per_epoch:
                raise ValueError(f"{name}: the number of steps per epoch is unknown (a dataset of unknown length); "
                                 "pass steps_per_epoch=")
        steps = _steps_per_execution(self.model)
        if self.needs_steps and steps > 1 and not self._warned_steps and aiacc.rank() == 0:
            self._warned_steps = True
            logger.warning(f"{name}: the model runs {steps} steps per call of its train function (compile("
                           f"steps_per_execution={steps})) and Keras calls batch callbacks once per call, at batches 0,"
                           f" {steps}, {2 * steps}, ...: the learning rate changes once per {steps} steps (each call's "
                           "steps use the rate of its first). For a per-step warmup or schedule, give the optimizer a "
                           "keras.optimizers.schedules.LearningRateSchedule as its learning_rate instead of this "
                           "callback, or compile with steps_per_execution=1")
        opt = self.model.optimizer
        opt = getattr(opt, "inner_optimizer", opt)  # (a LossScaleOptimizer has no momentum: its inner one's)
        self._momentum_of = None
        if not self.momentum_correction:
            return
        if "momentum" in (getattr(opt, "_hyper", None) or {}):  # Keras 2's legacy optimizers: a variable
            self._momentum_of = opt
        elif float(getattr(opt, "momentum", 0.0) or 0.0) and aiacc.rank() == 0:
            logger.warning(f"{name}: momentum_correction is not applied to {type(opt).__name__}: its momentum is a "
                           "Python number compiled into the train function (Keras 3's and Keras 2's "
                           "tf.keras.optimizers; Keras 2's tf.keras.optimizers.legacy ones take it)")

    def _position(self, batch):
        """(batch within the epoch, steps per epoch) of this fit's ``batch``: a fit that continues an epoch (the
        elastic resume recipe: ``UpdateBatchStateCallback`` notes the batches done before) counts on from them,
        its steps those plus its own (the rest of the epoch ran at the first batches' rates)."""
        before = getattr(self.model, BATCHES_BEFORE, 0)
        return before + batch, (self._given_steps or self.steps_per_epoch + before)

    def _set_learning_rate(self, lr: float) -> None:
        """Horovod's ``_adjust_learning_rate``: the new learning rate, and the momentum scaled by
        ``new_lr / old_lr`` until the batch ends."""
        opt, old = self._momentum_of, 0.0
        if opt is not None:
            try:
                old = float(np.asarray(opt.learning_rate))
            except (TypeError, ValueError):  # (a LearningRateSchedule: no rate to scale by)
                pass
        self.model.optimizer.learning_rate = lr
        if opt is not None and old:
            self.restore_momentum = float(np.asarray(opt.momentum))
            opt.momentum = self.restore_momentum * lr / old

    def on_train_batch_end(self, batch, logs=None):
        if self.restore_momentum is not None:
            self._momentum_of.momentum = self.restore_momentum
            self.restore_momentum = None

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:  # as Horovod's: the epoch's logs carry the learning rate (CSVLogger, TensorBoard)
            logs["lr"] = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))


def _number(value, what: str) -> float:
    """``value`` as a float, or a ValueError naming the argument (``float(None)``'s TypeError did not)."""
    if value is None:
        raise ValueError(f"{what} is required")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a number, got {value!r}") from None


class LearningRateWarmupCallback(_LearningRateCallback):
    """Horovod's gradual warmup: the learning rate rises linearly, batch by batch, from
    ``initial_lr / size`` to ``initial_lr`` over the first ``warmup_epochs`` epochs (Goyal et al., 2017).

    At batch ``b`` of epoch ``e`` (``e < warmup_epochs``) it sets
    ``lr = initial_lr / size * (1 + (size - 1) * (e + (b + 1) / steps_per_epoch) / warmup_epochs)``,
    exactly Horovod's formula, so the last warmup batch uses ``initial_lr``; afterwards it leaves the
    learning rate alone. ``steps_per_epoch`` defaults to what ``fit`` reports. ``verbose``: print when
    warmup ends (rank 0).

    ``momentum_correction`` (Horovod's): during warmup the momentum of each batch is multiplied by
    ``lr / previous lr``, with a Keras 2 legacy optimizer (``tf.keras.optimizers.legacy.SGD``); Keras 3's and
    Keras 2's ``tf.keras.optimizers`` compile their momentum into the train function, so it cannot change per
    batch there: a warning says so when the optimizer uses momentum.
    """

    def __init__(self, initial_lr, warmup_epochs=5, momentum_correction=True, steps_per_epoch=None, verbose=0):
        super().__init__(momentum_correction, steps_per_epoch)
        if warmup_epochs <= 0:
            raise ValueError(f"warmup_epochs={warmup_epochs} must be > 0")
        self.initial_lr = _number(initial_lr, "LearningRateWarmupCallback: initial_lr")
        self.warmup_epochs = warmup_epochs
        self.verbose = verbose

    def learning_rate_at(self, epoch, batch) -> float:
        """The learning rate this callback sets for ``batch`` of ``epoch`` during warmup."""
        n = aiacc.size()
        batch, steps = self._position(batch)
        progress = epoch + float(batch + 1) / steps
        return self.initial_lr / n * (progress * (n - 1) / self.warmup_epochs + 1)

    def on_train_batch_begin(self, batch, logs=None):
        if self.current_epoch >= self.warmup_epochs:
            return
        self._set_learning_rate(self.learning_rate_at(self.current_epoch, batch))

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if epoch == self.warmup_epochs - 1 and self.verbose and aiacc.rank() == 0:
            lr = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to {lr:g}.", flush=True)


class LearningRateScheduleCallback(_LearningRateCallback):
    """Horovod's learning-rate schedule: from ``start_epoch`` to ``end_epoch`` (exclusive; None: to the
    end) the learning rate is ``initial_lr * multiplier(epoch)``; a number ``m`` as ``multiplier`` means
    ``m ** (epoch - start_epoch)`` (exponential decay). ``staircase=True``: set at the first batch of each
    epoch; False: at every batch, with ``epoch + batch / steps_per_epoch`` (``steps_per_epoch`` defaults to
    what ``fit`` reports). Outside those epochs it leaves the learning rate alone (schedules chain, as in
    Horovod: ``[LearningRateWarmupCallback(...), LearningRateScheduleCallback(..., start_epoch=5), ...]``).
    ``momentum_correction`` as for :class:`LearningRateWarmupCallback` (each time the rate is set)."""

    def __init__(self, initial_lr, multiplier, start_epoch=0, end_epoch=None, staircase=True,
                 momentum_correction=True, steps_per_epoch=None):
        super().__init__(momentum_correction, steps_per_epoch)
        self.initial_lr = _number(initial_lr, "LearningRateScheduleCallback: initial_lr")
        if callable(multiplier):
            self.multiplier = multiplier
        else:
            factor = _number(multiplier, "LearningRateScheduleCallback: multiplier (a number or a function of the "
                                         "epoch)")
            self.multiplier = lambda epoch: factor ** (epoch - start_epoch)
        self.start_epoch, self.end_epoch = start_epoch, end_epoch
        self.staircase = staircase
        self.needs_steps = not staircase  # (per batch: fractional epochs)

    def on_train_batch_begin(self, batch, logs=None):
        epoch = self.current_epoch
        if epoch < self.start_epoch or (self.end_epoch is not None and epoch >= self.end_epoch):
            return
        if self.staircase:
            if batch == 0:
                self._set_learning_rate(self.initial_lr * self.multiplier(epoch))
        else:
            batch, steps = self._position(batch)
            self._set_learning_rate(self.initial_lr * self.multiplier(epoch + float(batch) / steps))


class BestModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """Horovod's ``ModelCheckpoint`` that keeps the best model only (``save_best_only=True``), for Keras 3.

    Horovod makes it without a path, which its Spark estimator sets (``callback.filepath``) before training;
    here ``filepath=`` may be given too (aiacc's; a ``.keras`` file, or ``.weights.h5`` with
    ``save_weights_only=True``). Training without either raises a ValueError naming ``filepath``. Every rank
    saves where it is used, as Keras' callback does: give it to rank 0's ``fit`` only, as Horovod's examples do
    with ``ModelCheckpoint``.
    """

    def __init__(self, monitor="val_loss", verbose=0, save_weights_only=False, mode="auto", save_freq="epoch",
                 filepath=None):
        stand_in = "best.weights.h5" if save_weights_only else "best.keras"  # (Keras checks the path at once)
        super().__init__(filepath=stand_in if filepath is None else filepath, monitor=monitor, verbose=verbose,
                         save_best_only=True, save_weights_only=save_weights_only, mode=mode, save_freq=save_freq)
        if filepath is None:
            self.filepath = None

    def on_train_begin(self, logs=None):
        if self.filepath is None:
            raise ValueError("BestModelCheckpoint: no filepath; give filepath= or set callback.filepath before "
                             "training (Horovod's Spark estimator sets it)")
        super().on_train_begin(logs)
