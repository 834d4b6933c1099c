"""``hvd.elastic`` for PyTorch: Horovod's ``TorchState`` over a model and an optimizer.

``commit()`` keeps a copy of the model's and the optimizer's state dicts (and of the keyword attributes),
``restore()`` loads them back, ``sync()`` gives every rank rank 0's (``broadcast_parameters`` and
``broadcast_optimizer_state``). Under ``aiaccrun --max-restarts N --elastic-dir DIR`` the commits also go to
DIR and a restarted job resumes from the last one (see :mod:`aiacc.elastic`)::

    sampler = hvd.elastic.ElasticSampler(dataset)             # each rank's share of what is left
    loader = torch.utils.data.DataLoader(dataset, batch_size=bs, sampler=sampler)
    state = hvd.elastic.TorchState(model=model, optimizer=opt, sampler=sampler, epoch=0)

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            ...
            for i, batch in enumerate(loader):
                ...
                sampler.record_batch(i, bs)
                state.commit()
            sampler.set_epoch(state.epoch + 1)          # at the end of an epoch, as in Horovod
"""

from __future__ import annotations

import copy
import importlib.machinery
import math
import random
import sys
import threading
import types
import weakref

import torch
import torch.utils.data

from aiacc import init, rank, shutdown, size  # noqa: F401 - init, shutdown: Horovod's elastic module has them
from aiacc.elastic import ElasticStateError, FrameworkPayload, ObjectState, State, idle_priority, restart_count, run
from aiacc.exceptions import HostsUpdatedInterrupt

from .functions import broadcast_object, broadcast_optimizer_state, broadcast_parameters

__all__ = ["State", "ObjectState", "TorchState", "ElasticSampler", "run", "restart_count", "ElasticStateError",
           "HostsUpdatedInterrupt"]


class ElasticSampler(torch.utils.data.Sampler):
    """Horovod's sampler for elastic training: like ``DistributedSampler`` it gives each rank its share of
    the dataset's indices (shuffled with ``seed + epoch``, the same order on every rank; padded by repeating
    the first indices so that every rank gets as many), and it counts how many samples the ranks have
    processed this epoch (``record_batch``). Its position (``epoch``, ``processed_num``) is part of a
    :class:`TorchState` given it as a keyword: committed, restored and synced with the model, and written
    with the commits, so a job that restarts (with as many ranks or another number) shares out only the
    indices not processed by the last commit. Call ``set_epoch`` at the end of an epoch (it starts the
    count again), ``record_batch(batch_idx, batch_size)`` after each batch (it adds ``batch_size`` times
    the number of ranks)."""

    def __init__(self, dataset, shuffle: bool = True, seed: int = 0):
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_num = 0
        self.num_replicas, self.rank = 1, 0
        self.remaining_indices, self.num_samples, self.total_size = [], 0, 0
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch``: a new order (with ``shuffle``), nothing processed yet."""
        self.epoch = epoch
        self.processed_num = 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Every rank has processed another batch of ``batch_size`` samples."""
        self.processed_num += batch_size * self.num_replicas

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def load_state_dict(self, state_dict: dict) -> None:
        self.epoch = state_dict["epoch"]
        self.processed_num = state_dict["processed_num"]
        self.reset()

    def reset(self) -> None:
        """Share out the indices of this epoch not processed yet among the ranks of the job as it is now."""
        self.num_replicas, self.rank = size(), rank()
        indices = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(indices)
        self.remaining_indices = indices[self.processed_num:]
        self.num_samples = int(math.ceil(len(self.remaining_indices) / self.num_replicas))
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self):
        indices = self.remaining_indices[:]
        indices += indices[:self.total_size - len(indices)]  # padded: every rank gets num_samples
        return iter(indices[self.rank:self.total_size:self.num_replicas])

    def __len__(self) -> int:
        return self.num_samples


def _stateful(value) -> bool:
    """Kept by a TorchState as its state dict: a model, an optimizer, or another object of torch's Stateful
    protocol (``state_dict()`` and ``load_state_dict()``: an lr scheduler, a GradScaler), as
    ``torch.distributed.checkpoint`` keeps them. (Pickled whole like ``epoch``, a scheduler came back from
    ``restore()`` or ``sync()`` bound to a copy of the optimizer, and stepping it changed nothing that trains.)"""
    if isinstance(value, (torch.nn.Module, torch.optim.Optimizer)):
        return True
    return (not isinstance(value, type) and callable(getattr(value, "state_dict", None))
            and callable(getattr(value, "load_state_dict", None)))


# What TorchState's own keywords take: (type, in words). Horovod picks a handler by the value's type whatever the
# keyword; aiacc keeps model= and optimizer= for those (other models and optimizers go in under other keywords).
_TAKES = {"model": (torch.nn.Module, "a torch.nn.Module"), "optimizer": (torch.optim.Optimizer, "a torch.optim.Optimizer")}


def _check_kind(name: str, value) -> None:
    """A TypeError naming the keyword (attribute) of a TorchState and what it takes, when ``value`` is not that."""
    ranks = getattr(getattr(value, "_aiacc_process_set", None), "ranks", None) or [0]
    if 0 not in ranks:  # (a restart gave the other ranks rank 0's untrained copy of its model, without a word)
        raise ElasticStateError(
            f"TorchState: {name}= is a DistributedOptimizer of process set {ranks}, which does not hold rank 0: a "
            "state commits and syncs rank 0's copy of all it holds, and rank 0 does not train this one (a restart "
            f"would give ranks {', '.join(map(str, ranks))} the untrained copy of rank 0). Train it on a process set "
            "that holds rank 0, or keep it out of the elastic state")
    if name in _TAKES:
        kind, what = _TAKES[name]
        if value is None or isinstance(value, kind):
            return
        other = next((k for k, (t, _) in _TAKES.items() if isinstance(value, t)), None)
        if other:
            hint = f" ({'a model' if other == 'model' else 'an optimizer'} goes in {other}=)"
        elif isinstance(value, type) and issubclass(value, kind):
            hint = f" (an instance, {name}={value.__name__}(...), not the class)"
        else:
            hint = ("; further models, optimizers, samplers and objects with state_dict() go in under other keywords "
                    "(TorchState(model=m, optimizer=o, disc=d, epoch=0))")
        raise TypeError(f"TorchState: {name}= takes {what} or None, got {_type_name(value)}{hint}")
    if not (isinstance(value, ElasticSampler) or _stateful(value)):
        raise TypeError(f"TorchState: state.{name} is kept as its state dict and takes an ElasticSampler, a model, an "
                        f"optimizer or an object with state_dict() and load_state_dict(), got {_type_name(value)}")


def _type_name(value) -> str:
    kind = value if isinstance(value, type) else type(value)
    return (f"the class {kind.__module__}.{kind.__qualname__}" if isinstance(value, type)
            else f"{kind.__module__}.{kind.__qualname__}")


def _copy_into(value, old):
    """A copy of ``value`` (tensors, and dicts/lists/tuples of them, as in state dicts) that no later training
    step changes, written into the tensors of ``old`` (an earlier copy of the same structure) where they fit:
    a copy into memory already touched costs a tenth of a fresh allocation's page faults."""
    if isinstance(value, torch.Tensor):
        value = value.detach()
        if (isinstance(old, torch.Tensor) and old.shape == value.shape and old.dtype == value.dtype
                and old.device == value.device and old.layout == value.layout == torch.strided
                and old.is_contiguous() and old.data_ptr() != value.data_ptr()):
            return old.copy_(value)
        return value.clone(memory_format=torch.contiguous_format) if value.layout == torch.strided else value.clone()
    if isinstance(value, dict):
        old = old if isinstance(old, dict) else {}
        return {k: _copy_into(v, old.get(k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        old = old if isinstance(old, (list, tuple)) and len(old) == len(value) else [None] * len(value)
        return type(value)(_copy_into(v, o) for v, o in zip(value, old))
    return copy.deepcopy(value)


def _tensor_from_array(array):
    """Unpickling a tensor written as its numpy array (a commit file): the tensor shares the file's bytes."""
    return torch.from_numpy(array)


class _AsArray:
    """A CPU tensor in a commit file: pickled as its numpy array (written raw, out of band) and read back
    as a tensor."""

    def __init__(self, array):
        self.array = array

    def __reduce__(self):
        return _tensor_from_array, (self.array,)


def _for_file(value):
    """``value`` with each CPU tensor that numpy can hold replaced by an :class:`_AsArray` of it (no copy)."""
    if isinstance(value, torch.Tensor):
        if value.device.type == "cpu" and value.layout == torch.strided and value.is_contiguous():
            try:
                return _AsArray(value.numpy())
            except (TypeError, RuntimeError):  # bfloat16 and other dtypes numpy lacks: torch pickles them
                pass
        return value
    if isinstance(value, dict):
        return {k: _for_file(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(_for_file(v) for v in value)
    return value


class _Copy:
    """One commit's copy of the model's and the optimizer's state. Its tensors are reused by a later commit
    once nothing needs them: neither ``restore()`` (the state's current copy) nor a commit file being
    written from them (``written`` is clear meanwhile)."""

    def __init__(self):
        self.model = None
        self.optimizer = None
        self.error = None
        self.done = threading.Event()
        self.written = threading.Event()
        self.written.set()


class TorchState(ObjectState):
    """The state of ``model`` and ``optimizer`` (either may be None) and of the keyword arguments, exposed as
    attributes (``state.epoch``).

    ``commit()`` returns after copying the model's parameters and buffers (code outside the optimizer may
    change them in place: the commit is what they were when it was called, as Horovod's deep copy); the
    optimizer's per-parameter state (moments), which only ``optimizer.step()`` changes, is copied by a
    background thread while the next forward and backward run, and ``step()`` waits for that copy first (a
    step pre-hook on ``optimizer`` and on every further optimizer given as a keyword, also one set on the state
    later: ``state.optimizer = ...``); its param groups (a
    scheduler may change a tensor learning rate in place) are copied in ``commit()``. Code that changes the
    moments in place outside ``step()`` after a commit should call ``state.save()`` again. Two copies are
    kept and reused in turn (the committed one and the one before, once its file is written), so a commit
    allocates no memory after the first two.

    A keyword argument that is an :class:`ElasticSampler` is kept as its position (``state_dict()``):
    ``restore()`` loads the committed one, ``sync()`` rank 0's. Further models and optimizers given as
    keywords (Horovod's way to keep several: ``TorchState(model=g, optimizer=og, disc=d, disc_opt=od)``), and
    other keywords with ``state_dict()`` and ``load_state_dict()`` (``scheduler=``, ``scaler=``), are kept as
    their state dicts, copied at each commit (not in the background), restored into the same objects and
    synced with ``broadcast_parameters`` / ``broadcast_optimizer_state`` / ``broadcast_object``."""

    def __init__(self, model=None, optimizer=None, **kwargs):
        self._ready = False  # until the first save: setting an attribute saves nothing yet
        self.model = model
        self.optimizer = optimizer
        self._samplers = tuple(k for k, v in kwargs.items() if isinstance(v, ElasticSampler))
        self._extras = tuple(k for k, v in kwargs.items() if k not in self._samplers and _stateful(v))
        for k in self._samplers + self._extras:
            setattr(self, k, kwargs.pop(k))
        self._saved_extras = {}
        self._save_samplers()
        self._copying = None  # (thread, copy) of a copy still running
        self._hooked = weakref.WeakSet()  # the optimizers whose step() waits for the copy
        self._box = None
        self._spare = None  # the copy before the current one, reused by the next save
        self._save_torch(background=False)
        super().__init__(bcast_object=broadcast_object, **kwargs)
        self._ready = True

    def __setattr__(self, name, value):
        """``state.model = other`` (or the optimizer, a sampler, a further model... given as a keyword): checked as
        at construction and saved at once, as Horovod's handlers do, so ``restore()`` before the next commit
        returns to the new object's state, not loads the old one's into it."""
        if name in _TAKES or name in self.__dict__.get("_samplers", ()) or name in self.__dict__.get("_extras", ()):
            _check_kind(name, value)
            if self._ready:
                super().__setattr__(name, value)
                self._save_one(name)
                return
        super().__setattr__(name, value)

    def _save_one(self, name: str) -> None:
        self._wait_copy()  # (its end would set the saved model and optimizer of the commit before)
        value = getattr(self, name)
        with torch.no_grad():
            if name == "model":
                self._saved_model = (None if value is None else
                                     {k: _copy_into(v, None) for k, v in value.state_dict(keep_vars=True).items()})
            elif name == "optimizer":
                self._saved_optimizer = None if value is None else _copy_into(value.state_dict(), None)
            elif name in self._samplers:
                self._saved_samplers = dict(self._saved_samplers, **{name: copy.deepcopy(value.state_dict())})
            else:
                self._saved_extras = dict(self._saved_extras, **{name: _copy_into(value.state_dict(), None)})

    def _save_torch(self, background: bool = True):
        self._wait_copy()
        model, optimizer = self.model, self.optimizer
        old = self._spare
        if old is not None:
            old.written.wait()  # a commit file still being written from it (rare: save() without commit())
        box = _Copy()
        box.written.set()
        if model is not None:  # parameters and buffers: now (code outside the optimizers may change them in place)
            old_model = old.model if old is not None else None
            with torch.no_grad():
                box.model = {k: _copy_into(v, (old_model or {}).get(k))
                             for k, v in model.state_dict(keep_vars=True).items()}
        # the optimizer's state dict is taken here (its structure follows param_groups, which an optimizer
        # wrapper may rearrange while it works), and all of it but the per-parameter state copied now (a
        # scheduler changes a tensor learning rate in place: ``fill_``); the thread copies that state's tensors,
        # which only ``step()`` changes
        optimizer_state = optimizer.state_dict() if optimizer is not None else None
        old_optimizer = old.optimizer if old is not None and isinstance(old.optimizer, dict) else {}
        if optimizer_state is not None:
            with torch.no_grad():
                box.optimizer = {k: v if k == "state" else _copy_into(v, old_optimizer.get(k))
                                 for k, v in optimizer_state.items()}

        def copy_rest():
            if background:
                idle_priority()
            try:
                if optimizer_state is not None and "state" in optimizer_state:
                    with torch.no_grad():
                        box.optimizer["state"] = _copy_into(optimizer_state["state"], old_optimizer.get("state"))
            except BaseException as exc:  # noqa: BLE001 - raised where the copy is waited for
                box.error = exc
            finally:
                box.done.set()

        if background and optimizer is not None:
            # the only code that changes their state: each optimizer waits for the copy, also one put on the
            # state after the first commit (``state.optimizer = ...``, say in a reset callback)
            for opt in (optimizer,) + tuple(getattr(self, k) for k in self._extras):
                if isinstance(opt, torch.optim.Optimizer) and opt not in self._hooked:
                    opt.register_step_pre_hook(lambda *_: self._wait_copy())  # (a further one may step these)
                    self._hooked.add(opt)
            # not a daemon: the interpreter's exit waits for the copy (a daemon thread still inside torch's copy
            # at exit is ended in the middle of C++ code, and the process aborts: a script whose last line commits)
            thread = threading.Thread(target=copy_rest, name="aiacc-elastic-copy", daemon=False)
            self._copying = (thread, box)
            thread.start()
        else:
            copy_rest()
            self._take(box)

    def _take(self, box):
        if box.error is not None:
            raise ElasticStateError(f"TorchState: copying the state failed: {box.error}") from box.error
        self._spare, self._box = self._box, box
        self._saved_model, self._saved_optimizer = box.model, box.optimizer

    def _wait_copy(self):
        copying, self._copying = self._copying, None
        if copying is not None:
            thread, box = copying
            thread.join()
            self._take(box)

    def _save_samplers(self):
        self._saved_samplers = {k: copy.deepcopy(getattr(self, k).state_dict()) for k in self._samplers}
        with torch.no_grad():
            self._saved_extras = {k: _copy_into(getattr(self, k).state_dict(), self._saved_extras.get(k))
                                  for k in self._extras}

    def save(self):
        self._save_torch()
        self._save_samplers()
        super().save()

    def restore(self):
        self._wait_copy()
        if self.model is not None:
            self.model.load_state_dict(self._saved_model)  # copies into the parameters
        if self.optimizer is not None:
            # load_state_dict adopts tensors of the right dtype and device as they are: the live state must
            # not be the saved copy, which the next steps would change (and a later commit reuses)
            self.optimizer.load_state_dict(_copy_into(self._saved_optimizer, None))
        for k, position in self._saved_samplers.items():
            getattr(self, k).load_state_dict(copy.deepcopy(position))
        for k, saved in self._saved_extras.items():  # (a fresh copy: the next commit reuses the saved one)
            getattr(self, k).load_state_dict(_copy_into(saved, None))
        super().restore()

    def sync(self):
        self._wait_copy()
        if self.model is not None:
            broadcast_parameters(self.model.state_dict(), root_rank=0)
        if self.optimizer is not None:
            broadcast_optimizer_state(self.optimizer, root_rank=0)
        for k in self._extras:
            extra = getattr(self, k)
            if isinstance(extra, torch.nn.Module):
                broadcast_parameters(extra.state_dict(), root_rank=0)
            elif isinstance(extra, torch.optim.Optimizer):
                broadcast_optimizer_state(extra, root_rank=0)
            else:  # a scheduler, a GradScaler: rank 0's state dict, loaded into this rank's object
                extra.load_state_dict(broadcast_object(extra.state_dict(), root_rank=0))
        if self._samplers:
            positions = broadcast_object({k: getattr(self, k).state_dict() for k in self._samplers}, root_rank=0)
            for k, position in positions.items():
                getattr(self, k).load_state_dict(position)  # (shared out among the ranks there are now)
        self._save_samplers()
        self._save_torch(background=False)
        super().sync()

    def _framework_payload(self):
        box = self._copying[1] if self._copying is not None else self._box
        box.written.clear()  # until the writer is done with it, no save() reuses it
        samplers = self._saved_samplers  # (replaced whole by every save, never changed in place)
        extras = _copy_into(self._saved_extras, None)  # (the next save writes into the saved copy)

        def payload():
            box.done.wait()  # on the writer's thread: the copy of this commit is complete
            return {"model": _for_file(box.model), "optimizer": _for_file(box.optimizer), "samplers": samplers,
                    "extras": _for_file(extras)}
        return FrameworkPayload(payload, box.written.set)

    def _load_persisted(self, payload: dict) -> None:
        self._wait_copy()
        self._saved_model, self._saved_optimizer = payload["model"], payload["optimizer"]
        self._saved_samplers = payload.get("samplers", {})
        self._saved_extras = payload.get("extras", {})
        self._box = self._spare = None  # the loaded tensors are no copy of ours to reuse
        super()._load_persisted(payload)

    def _layout(self) -> str:
        parts = [super()._layout()]
        if self.model is not None:
            parts.append(";".join(f"{k}{tuple(v.shape)}" for k, v in self.model.state_dict().items()))
        if self.optimizer is not None:
            parts.append(type(self.optimizer).__name__)
        if self._samplers:
            parts.append("samplers:" + ",".join(self._samplers))
        for k in self._extras:
            extra = getattr(self, k)
            parts.append(f"{k}:" + (";".join(f"{n}{tuple(v.shape)}" for n, v in extra.state_dict().items())
                                    if isinstance(extra, torch.nn.Module) else type(extra).__name__))
        return "|".join(parts)


def _submodule(name: str, doc: str, **names) -> None:
    module = types.ModuleType(f"{__name__}.{name}", doc)
    module.__dict__.update(names, __all__=list(names))
    module.__spec__ = importlib.machinery.ModuleSpec(module.__name__, None)
    sys.modules[module.__name__] = module
    globals()[name] = module  # (``hvd.elastic.sampler``, as an import of a package's module sets it)


__path__ = []  # a package to the import system, so that an alias of this module (horovod.torch.elastic) finds them


# Horovod's horovod.torch.elastic is a package whose modules scripts import from (its examples:
# ``from horovod.torch.elastic.sampler import ElasticSampler``): the same classes under those names
_submodule("sampler", "ElasticSampler, as in Horovod's horovod.torch.elastic.sampler.", ElasticSampler=ElasticSampler)
_submodule("state", "The state classes, as in Horovod's horovod.torch.elastic.state.", TorchState=TorchState,
           ObjectState=ObjectState, State=State)
