"""aiacc as a ``torch.distributed`` backend: ``dist.init_process_group("aiacc")``.

``import aiacc.torch`` registers the backend. Under ``aiaccrun`` (which sets torchrun's variables
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` for every rank)::

    import torch.distributed as dist
    import aiacc.torch

    dist.init_process_group("aiacc")
    model = torch.nn.parallel.DistributedDataParallel(model)

Every collective of the process group runs on the aiacc engine (MPI through mpi4py), asynchronously:
it returns a ``Work`` whose ``wait()`` blocks until the engine has finished and whose ``get_future()``
completes on the engine's thread, so DDP (with its communication hooks), ZeroRedundancyOptimizer and
FSDP work unchanged. The rank and size come from MPI; torch's rendezvous (the ``env://`` store) only
has to agree with them, and a difference is an error naming both.

Each group (the default one and every ``dist.new_group`` over all ranks) names its operations apart from the
others', so groups are independent channels, as over gloo. A sub-group (``dist.new_group`` with fewer ranks than
the job, ``dist.new_subgroups``, ``use_local_synchronization=True``) is built on its members only, as torch calls
the backend there alone: a process set of its members (``aiacc.api.add_members_only_set``: a communicator made by
``MPI_Comm_create_group`` over them, an engine of its own that negotiates among them), so its operations run among
the members only, beside the default group's, and the other ranks call nothing. ``dist.destroy_process_group(g)``
stops its engine, for its other members too (their operations on it after that are an error naming it). What it
does not do, each an error that says so: ``ReduceOp.PREMUL_SUM`` (NCCL's), ``recv`` from any source. What torch's
Python asks of a group beyond its collectives (its devices, its backend per device, ``dist.monitored_barrier``) is in
``group_devices.py``.

Timeouts, as over gloo: a group's ``timeout`` (``init_process_group`` / ``new_group``; torch's default, 30 min,
when none is given) bounds every wait for its collectives (``Work.wait``, the Work's future through a timer thread
in ``works.py``): past it, a RuntimeError names the operation, the group, the timeout and the ranks that have not
joined it (``AiaccProcessGroup.timed_out``), and the group is unusable on that rank. ``work.wait(timeout)`` raises
after its own timeout and leaves the group usable. A sub-group's creation waits at most its timeout for its members
(``aiacc.api.add_members_only_set(..., timeout=...)``). ``send`` / ``recv`` too (``p2p.PointToPoint``).
"""

from __future__ import annotations

import datetime
import zlib
from typing import List, Optional

import numpy as np
import torch
import torch.distributed as dist

import aiacc
from aiacc.devices import array_module, data_ptr, device_of
from aiacc.ops import Collective, ReduceOp

from . import mpi_ops
from .group_devices import GroupDevices, install_monitored_barrier
from .arrays import flat, into
from .untraced import not_traced
from .p2p import PointToPoint, finish as finish_p2p
from .works import Chain, DoneWork, Work, finish_group, seconds_of

__all__ = ["AiaccProcessGroup", "register"]

BACKEND = "aiacc"
# a group's timeout when torch gives none: torch's default for backends other than NCCL (30 min)
_DEFAULT_TIMEOUT = dist.constants.default_pg_timeout
SLOTS = 60  # names per kind of operation (divisible by 1..6, 10, 12, 15, 20, 30: the operations per step)

_TORCH_OPS = {
    dist.ReduceOp.SUM: ReduceOp.SUM,
    dist.ReduceOp.AVG: ReduceOp.AVERAGE,
    dist.ReduceOp.PRODUCT: ReduceOp.PRODUCT,
    dist.ReduceOp.MIN: ReduceOp.MIN,
    dist.ReduceOp.MAX: ReduceOp.MAX,
    dist.ReduceOp.BAND: ReduceOp.BAND,
    dist.ReduceOp.BOR: ReduceOp.BOR,
    dist.ReduceOp.BXOR: ReduceOp.BXOR,
}


def _op(torch_op, what: str) -> ReduceOp:
    for key, value in _TORCH_OPS.items():
        if torch_op == key:
            return value
    raise ValueError(f"aiacc backend: {what} with {getattr(torch_op, 'op', torch_op)} is not supported (PREMUL_SUM "
                     "is NCCL's); use SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR or BXOR")


class AiaccProcessGroup(GroupDevices, dist.ProcessGroup):
    """A ``torch.distributed`` process group whose collectives run on the aiacc engine."""

    def __init__(self, rank: int, size: int, comm=None, number: int = 0, process_set=None, timeout=None):
        super().__init__(rank, size)
        # how long a collective's wait lasts (init_process_group / new_group's ``timeout``; torch gives its
        # default, 30 min, when none was); after a wait past it the group is unusable: _broken says why
        self._timeout = seconds_of(timeout) or seconds_of(_DEFAULT_TIMEOUT)
        self._broken = ""
        self._p2p = comm  # send / recv: a communicator of its own, apart from the engine's collectives
        # a sub-group: aiacc's process set of its members only (its own engine); None: the job's engine
        self._set = process_set
        self._ranks = list(process_set.ranks) if process_set is not None else None  # global ranks, by group rank
        self._destroyed = ""  # why this sub-group's operations are refused (it was destroyed)
        # Groups share the engine, so each has names of its own: the first (the default group) ``c10d.``,
        # the k-th made after it ``c10d.g<k>.``. torch makes every group on every rank in the same order.
        self._prefix = f"c10d.g{number}." if number else "c10d."
        self._group_name = self._desc = ""
        self._seq = {}  # kind -> operations so far
        self._slots = {}  # name -> the engine's handle of the last operation under that name

    def getBackendName(self) -> str:  # noqa: N802 - torch's names
        return BACKEND

    # torch names every group (DeviceMesh and the functional collectives look groups up by name); the
    # base class keeps names in its C++ backends, which a Python group has none of
    def getGroupName(self) -> str:  # noqa: N802
        return self._group_name

    def setGroupName(self, name: str) -> None:  # noqa: N802
        self._group_name = name

    def getGroupDesc(self) -> str:  # noqa: N802
        return self._desc

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self._desc = desc

    def __repr__(self) -> str:
        return f"AiaccProcessGroup(rank={self.rank()}, size={self.size()})"

    def _job_rank(self, root: int) -> int:  # a root's rank in this group -> in the job (what the engine takes)
        return root if self._ranks is None else self._ranks[root]

    # ---- names ----------------------------------------------------------------------------------
    def _name(self, kind: str) -> str:
        """The engine's name for this group's next ``kind`` operation: ``c10d.<kind>.<k>`` (``c10d.g<g>.<kind>.<k>``
        in the g-th group made after the first) with k its sequence number modulo SLOTS. Groups over the same
        ranks do not share names: their operations may interleave in any order, as over gloo. Every rank issues a
        group's operations in the same order (torch's rule), so every rank gives an operation the same name, and a
        training loop whose step issues a number of operations that divides SLOTS reuses names with the same
        signatures step after step: the engine's response cache agrees each by one bit instead of by exchanging its
        description. (Different shapes across ranks share a name, so they are an error that names them, never a
        stall.) A name is reused only once its previous operation has finished."""
        if self._broken or self._set is not None:
            self._check_usable(kind)
        seq = self._seq.get(kind, 0)
        self._seq[kind] = seq + 1
        name = f"{self._prefix}{kind}.{seq % SLOTS}"
        previous = self._slots.pop(name, None)
        if previous is not None and not previous.done():
            previous.wait()
        return name

    def _submit(self, kind: Collective, what: str, source: torch.Tensor, **kwargs):
        """Submit ``source`` (contiguous) as this group's next ``what`` operation of ``kind``: the engine's
        request, tracked under its name."""
        name = self._name(what)
        core = aiacc.submit(kind, mpi_ops.to_numpy(source, None), name=name, process_set=self._set, **kwargs)
        self._track(name, core)
        return core

    def _track(self, name: str, handle):
        """Remember ``handle`` (a torch adapter Handle or the engine's) as the operation under ``name``."""
        self._slots[name] = getattr(handle, "_core", handle)
        return handle

    # ---- allreduce ----------------------------------------------------------------------------
    def allreduce(self, tensors: List[torch.Tensor], opts=None):
        # also the base class's short form ``pg.allreduce(tensor, op)``: DDP under Join reduces the joined rank's
        # map of used parameters so (find_unused_parameters=True); its elements were taken for tensors of their own
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else tensors
        op = _op(_option(opts, "reduceOp", dist.ReduceOp.SUM), "all_reduce")
        name = self._name("allreduce")
        handle = self._track(name, mpi_ops._submit_allreduce(tensors, name, op, 1.0, 1.0, None, inplace=True,
                                                              group=len(tensors) > 1, process_set=self._set))
        return self._work(opts, handle, list(tensors))

    def allreduce_coalesced(self, tensors: List[torch.Tensor], opts=None):
        op = _op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM, "all_reduce_coalesced")
        name = self._name("allreduce")
        handle = self._track(name, mpi_ops._submit_allreduce(tensors, name, op, 1.0, 1.0, None, inplace=True,
                                                              group=True, process_set=self._set))
        return self._work(opts, handle, list(tensors))

    def reduce(self, tensors: List[torch.Tensor], opts=None):
        """``dist.reduce``: an allreduce that only the root keeps; a group of one, whose signature carries the root."""
        if len(tensors) != 1:
            raise ValueError("aiacc backend: reduce takes one tensor per process")
        op = _op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM, "reduce")
        root, t, source = (opts.rootRank if opts is not None else 0), tensors[0], flat(tensors[0])
        name, array, mine = self._name("reduce"), mpi_ops.to_numpy(source, None), root == self.rank()
        core = self._track(name, aiacc.submit(Collective.ALLREDUCE, [array], name=name, op=op, process_set=self._set,
                                              root=self._job_rank(root), outputs=[array] if mine else None))
        back = mine and source.data_ptr() != t.data_ptr()  # (a strided tensor, reduced in a copy)
        return self._work(opts, mpi_ops.Handle(core, None), [t], (lambda: t.copy_(source.view_as(t))) if back else None)

    # ---- allgather ----------------------------------------------------------------------------
    def _gather_into(self, output: torch.Tensor, input: torch.Tensor, what: str):
        self._check_sizes(output.numel(), input.numel() * self.size(), what, "output", "input")
        self._check_dtypes(output, input, what)
        # (FSDP gathers in place, its shard a view of the output: the engine sends such an input from a copy)
        core = self._submit(Collective.ALLGATHER, "allgather", flat(input), allocate=into(output))
        return mpi_ops.Handle(core, None), lambda: _land(output, core.wait(), what)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts=None):
        handle, finish = self._gather_into(output, input, "all_gather_into_tensor")
        return self._work(opts, handle, [output], finish)

    _allgather_base = all_gather_single

    def allgather_coalesced(self, output_lists, inputs, opts=None):  # (torch's error named no backend)
        raise NotImplementedError("aiacc backend: all_gather_coalesced (deprecated in torch) is not supported; call "
                                  "all_gather for each tensor")

    def allgather(self, output_lists: List[List[torch.Tensor]], inputs: List[torch.Tensor], opts=None):
        if len(inputs) != 1 or len(output_lists) != 1:
            raise ValueError("aiacc backend: all_gather takes one input tensor per process")
        outputs, input = output_lists[0], inputs[0]
        self._check_sizes(len(outputs), self.size(), "all_gather", "output list length", "group size")
        for i, o in enumerate(outputs):
            self._check_sizes(o.numel(), input.numel(), "all_gather", f"output[{i}]", "input")
        gathered = torch.empty(input.numel() * self.size(), dtype=input.dtype, device=input.device)
        handle, gather_finish = self._gather_into(gathered, input, "all_gather")

        def finish():
            gather_finish()
            with torch.no_grad():
                for o, piece in zip(outputs, gathered.chunk(self.size())):
                    o.copy_(piece.view(o.shape))
        return self._work(opts, handle, [outputs], finish)

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        works = [self.all_gather_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return Chain(works, list(outputs))

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    # ---- reduce-scatter -----------------------------------------------------------------------
    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts=None):
        op = _op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM, "reduce_scatter_tensor")
        self._check_sizes(input.numel(), output.numel() * self.size(), "reduce_scatter_tensor", "input", "output")
        self._check_dtypes(output, input, "reduce_scatter_tensor")
        core = self._submit(Collective.REDUCESCATTER, "reducescatter", flat(input), op=op, allocate=into(output))
        return self._work(opts, mpi_ops.Handle(core, None), [output],
                          lambda: _land(output, core.wait(), "reduce_scatter_tensor"))

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter(self, outputs: List[torch.Tensor], input_lists: List[List[torch.Tensor]], opts=None):
        if len(outputs) != 1 or len(input_lists) != 1:
            raise ValueError("aiacc backend: reduce_scatter takes one output tensor per process")
        output, inputs = outputs[0], input_lists[0]
        self._check_sizes(len(inputs), self.size(), "reduce_scatter", "input list length", "group size")
        # each one, not their total: inputs of other sizes with the right total were cut at the wrong places
        for i, t in enumerate(inputs):
            self._check_sizes(t.numel(), output.numel(), "reduce_scatter", f"input_list[{i}]", "output")
        return self.reduce_scatter_single(output, torch.cat([flat(t) for t in inputs]), opts)

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        works = [self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return Chain(works, list(outputs))

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # ---- gather and scatter: an alltoall in which only the root sends or receives ------------------
    def gather(self, output_lists: List[List[torch.Tensor]], inputs: List[torch.Tensor], opts=None):
        """``dist.gather``: every rank sends its tensor to the root only (an alltoall with one row for
        the root, none for the others)."""
        root = opts.rootRank if opts is not None else 0
        if len(inputs) != 1:
            raise ValueError("aiacc backend: gather takes one input tensor per process")
        input = inputs[0]
        outputs = output_lists[0] if output_lists else []
        mine = root == self.rank()
        if mine:
            self._check_sizes(len(outputs), self.size(), "gather", "gather_list length", "group size")
            for i, o in enumerate(outputs):
                self._check_sizes(o.numel(), input.numel(), "gather", f"gather_list[{i}]", "input")
        core = self._submit(Collective.ALLTOALL, "gather", flat(input).reshape(1, -1),
                            splits=[1 if k == root else 0 for k in range(self.size())])

        def finish():
            got, _ = core.wait()
            if mine:
                with torch.no_grad():
                    for o, piece in zip(outputs, got):
                        o.copy_(mpi_ops.from_array(_contiguous(piece), o.dtype).view(o.shape))
        return self._work(opts, mpi_ops.Handle(core, None), [outputs], finish)

    def scatter(self, outputs: List[torch.Tensor], input_lists: List[List[torch.Tensor]], opts=None):
        """``dist.scatter``: the root sends the k-th tensor of its list to rank k (an alltoall in which
        the others send nothing)."""
        root = opts.rootRank if opts is not None else 0
        if len(outputs) != 1:
            raise ValueError("aiacc backend: scatter takes one output tensor per process")
        output = outputs[0]
        if root == self.rank():
            inputs = input_lists[0]
            self._check_sizes(len(inputs), self.size(), "scatter", "scatter_list length", "group size")
            for i, t in enumerate(inputs):
                self._check_sizes(t.numel(), output.numel(), "scatter", f"scatter_list[{i}]", "output")
            source = torch.stack([flat(t) for t in inputs]) if inputs else None
            splits = [1] * self.size()
        else:
            source = output.new_empty((0, output.numel())).detach()
            splits = [0] * self.size()
        core = self._submit(Collective.ALLTOALL, "scatter", source, splits=splits)
        return self._work(opts, mpi_ops.Handle(core, None), [output], lambda: _land(output, core.wait()[0], "scatter"))

    # ---- broadcast ----------------------------------------------------------------------------
    def broadcast(self, tensors: List[torch.Tensor], opts=None):
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else tensors  # ``pg.broadcast(tensor, root)``
        root = self._job_rank(_option(opts, "rootRank", 0))
        if len(tensors) == 1:
            name = self._name("broadcast")
            handle = self._track(name, mpi_ops.broadcast_async_(tensors[0], root, name, self._set))
            return self._work(opts, handle, list(tensors))
        works = []
        for t in tensors:
            name = self._name("broadcast")
            works.append(self._work(opts, self._track(name, mpi_ops.broadcast_async_(t, root, name, self._set)), [t]))
        return Chain(works, list(tensors))

    # ---- alltoall -----------------------------------------------------------------------------
    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes, input_split_sizes,
                          opts=None):
        n = self.size()
        rows = input.shape[0] if input.dim() else 1
        row = input.numel() // max(rows, 1)
        splits = list(input_split_sizes) if input_split_sizes else None
        if splits is None and rows % n:
            raise ValueError(f"aiacc backend: all_to_all_single of {rows} rows over {n} ranks needs input_split_sizes")
        source = input.detach().contiguous().reshape(rows, row) if input.dim() else input.detach().reshape(1, 1)
        core = self._submit(Collective.ALLTOALL, "alltoall", source, splits=splits, allocate=into(output))
        expected = list(output_split_sizes) if output_split_sizes else None

        def finish():
            got, received = core.wait()
            received = [int(k) for k in received]
            if expected is not None and expected != received:
                raise ValueError(f"aiacc backend: all_to_all_single on rank {self.rank()}: output_split_sizes "
                                 f"{expected}, but the ranks sent {received} rows")
            if got.size != output.numel():
                raise ValueError(f"aiacc backend: all_to_all_single on rank {self.rank()}: output has size "
                                 f"{output.numel()}, but {sum(received)} rows of size {row} ({got.size}) arrived "
                                 f"(from each rank: {received})")
            _land(output, got)
        return self._work(opts, mpi_ops.Handle(core, None), [output], finish)

    alltoall_base = all_to_all_single

    def alltoall(self, outputs: List[torch.Tensor], inputs: List[torch.Tensor], opts=None):
        self._check_sizes(len(inputs), self.size(), "all_to_all", "input list length", "group size")
        self._check_sizes(len(outputs), self.size(), "all_to_all", "output list length", "group size")
        if not inputs:
            return DoneWork([outputs])
        flat_in = torch.cat([flat(t) for t in inputs])
        flat_out = torch.empty(sum(o.numel() for o in outputs), dtype=flat_in.dtype)
        counts = [o.numel() for o in outputs]
        core = self._submit(Collective.ALLTOALL, "alltoall", flat_in, splits=[t.numel() for t in inputs],
                            allocate=into(flat_out))

        def finish():
            _land(flat_out, core.wait()[0], "all_to_all")
            with torch.no_grad():
                for o, piece in zip(outputs, flat_out.split(counts)):
                    o.copy_(piece.view(o.shape))
        return self._work(opts, mpi_ops.Handle(core, None), [outputs], finish)

    # ---- barrier and point-to-point -----------------------------------------------------------
    def barrier(self, opts=None):
        """``dist.barrier``: the engine's barrier, waited for under the group's timeout (or ``opts.timeout``)."""
        self._check_usable("barrier")
        core = aiacc.submit(Collective.BARRIER, [], name=None, process_set=self._set)
        return self._work(opts, mpi_ops.Handle(core, None), None)

    # ---- timeouts -----------------------------------------------------------------------------
    def _work(self, opts, handle, result, finish=None) -> Work:
        """The Work of an operation of this group: its wait lasts ``opts.timeout`` when torch's options set one,
        else the group's timeout."""
        timeout = getattr(opts, "timeout", None)
        # (torch leaves it unset, negative, unless a caller set one: then no conversion, 0.2 µs of each operation)
        unset = timeout is None or (timeout.__class__ is datetime.timedelta and timeout.days < 0)
        return Work(handle, result, finish, self, None if unset else seconds_of(timeout))

    def _describe(self) -> str:
        ranks = self._ranks if self._ranks is not None else list(range(self.size()))
        name = f" {self._group_name!r}" if self._group_name else ""
        return f"the process group{name} of ranks {ranks}"

    def timed_out(self, name: str, seconds: float, explicit: bool, done=None) -> Optional[RuntimeError]:
        """The error of a wait for this group's operation ``name`` (the engine's name) that did not end within
        ``seconds``: ``work.wait(timeout)``'s own (``explicit``: the work still runs and may be waited for again),
        or the group's (the group is unusable from now on, as a gloo group whose collective timed out: the
        operation cannot be withdrawn from the other ranks, and a later one would pair with the wrong one of a
        rank that comes late). Names the operation, the group, the timeout and, from the engine's stall report,
        the ranks that have not joined the operation. None when ``done()`` says it ended meanwhile (while the
        engine was asked which ranks have not joined it): no error, the group stays usable."""
        kind = name.split(".")[-2] if name.count(".") >= 2 else "operation"
        found = aiacc.api.missing_ranks(name, self._set, wait=min(5.0, max(1.0, seconds)))
        if done is not None and done():
            return None
        if found is None:
            who = "; which ranks have not joined it is unknown (no answer from the other ranks' engines)"
        elif found[1]:
            have, missing = found
            who = (f": rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} "
                   f"{'have' if len(missing) > 1 else 'has'} not joined it (rank{'s' if len(have) > 1 else ''} "
                   f"{', '.join(map(str, have))} did)")
        else:
            who = ": every rank has joined it; it is still running"
        text = (f"aiacc backend: Timed out waiting {round(seconds * 1000)}ms for {kind} (operation {name!r}) on rank "
                f"{aiacc.rank()} of {self._describe()}, timeout {datetime.timedelta(seconds=seconds)} "
                f"({'work.wait(timeout=...)' if explicit else 'the timeout of the process group'}){who}")
        if explicit:
            return RuntimeError(text + "; the operation still runs: wait for it again, or end the job")
        return RuntimeError(self.unusable_after(text))

    def unusable_after(self, text: str) -> str:
        """``text``, the error of a wait past the group's timeout, which makes the group unusable from now on."""
        if not self._broken:
            self._broken = text
        return text + ("; the process group is unusable from now on (end the job, or destroy the group and make a new "
                       "one)")

    def _check_usable(self, kind: str) -> None:
        """An operation ``kind`` is refused, naming why, once a wait on the group timed out or (a sub-group) its
        process set is gone."""
        if self._broken:
            raise RuntimeError(f"aiacc backend: {kind} on {self._describe()}, which is unusable since an earlier "
                               f"wait timed out: {self._broken}")
        if self._set is not None:
            self._check_alive(kind)

    def _check_alive(self, kind: str) -> None:
        """A sub-group's operation ``kind`` is refused, naming why, once its process set is gone."""
        if not self._destroyed and self._set.process_set_id is None:
            self._destroyed = f"the process group of ranks {self._ranks}, whose engine aiacc.shutdown() stopped"
        if self._destroyed:
            raise RuntimeError(f"aiacc backend: {kind} on {self._destroyed}")

    def shutdown(self) -> None:
        """``dist.destroy_process_group(group)`` (and of the default group, for every group): a sub-group's engine
        stops, for its other members too (what they start on the group after it is an error naming it), and its
        communicators are freed. Groups over all ranks run on the job's engine, which ``aiacc.shutdown`` stops. First,
        its collectives and point-to-point operations still in flight end (``works.finish_group``; ``p2p.finish``: a
        peer may still take a dropped send)."""
        finish_group(self)
        finish_p2p(self)
        if self._set is not None and not self._destroyed:
            self._destroyed = (f"the process group of ranks {self._ranks}, which was destroyed on rank {aiacc.rank()} "
                               "(dist.destroy_process_group)")
            aiacc.api.remove_members_only_set(self._set, reason=self._destroyed)

    def _comm(self):
        if self._p2p is None:
            raise ValueError("aiacc backend: send / recv in a job of one process (aiacc is switched off)")
        return self._p2p

    # point-to-point goes over MPI, which reads host memory only (the mpich wheel is not CUDA-aware): a CUDA
    # tensor is staged through a host copy. Its wait honours the group's timeout and work.wait's (works.py)
    def send(self, tensors: List[torch.Tensor], dst: int, tag: int = 0):
        self._check_usable("send")
        t = tensors[0].detach()
        t = t.cpu() if t.is_cuda else t
        buffer = _p2p_buffer(t if t.is_contiguous() else t.contiguous())  # (kept by the work until MPI is done)
        request = self._comm().Isend(buffer, dest=dst, tag=tag)
        return PointToPoint(request, list(tensors), self, "send", dst, tag, buffer=buffer)

    def recv(self, tensors: List[torch.Tensor], src: int, tag: int = 0):
        self._check_usable("recv")
        t = tensors[0]
        staged = t.detach() if t.is_contiguous() and not t.is_cuda else torch.empty_like(t, device="cpu")
        buffer = _p2p_buffer(staged)
        request = self._comm().Irecv(buffer, source=src, tag=tag)

        def finish():
            if staged.data_ptr() != t.data_ptr():
                with torch.no_grad():
                    t.copy_(staged)
        return PointToPoint(request, list(tensors), self, "recv", src, tag, finish, buffer)

    def recv_anysource(self, tensors, tag: int = 0):
        raise ValueError("aiacc backend: recv without a source (recv_anysource) is not supported; pass src=")

    # ---- checks -------------------------------------------------------------------------------
    def _check_sizes(self, got: int, want: int, what: str, got_name: str, want_name: str) -> None:
        """``got`` (the size of ``got_name``) must be ``want`` (from ``want_name``): else an error naming both."""
        if got != want:
            raise ValueError(f"aiacc backend: {what} on rank {aiacc.rank()}: {got_name} has size {got}, expected "
                             f"{want} from the {want_name} and the group size {self.size()}")

    @staticmethod
    def _check_dtypes(output: torch.Tensor, input: torch.Tensor, what: str) -> None:
        """The engine writes ``input``'s elements into ``output``'s memory as they are (torch checks the other
        collectives' dtypes itself, not these): a float32 input gathered into float64 was garbage, a reduce-scatter
        of them ended the job from the engine's thread."""
        if output.dtype != input.dtype:
            raise ValueError(f"aiacc backend: {what} on rank {aiacc.rank()}: the output is "
                             f"{str(output.dtype).replace('torch.', '')}, the input "
                             f"{str(input.dtype).replace('torch.', '')}; pass tensors of one dtype")


def _option(opts, field: str, default):
    """``opts.<field>`` of torch's options object, or ``opts`` itself where the caller used the base class's short
    form and gave the value (``pg.allreduce(tensor, op)``, ``pg.broadcast(tensor, root)``)."""
    if opts is None:
        return default
    return getattr(opts, field, opts)


def _p2p_buffer(t: torch.Tensor):
    """``t``'s memory for MPI's send / recv, as bytes: the receive checks the size that came (``p2p._test``); typed,
    a float32 message into a float64 tensor ended the job on an MPICH assertion (and bfloat16 had no MPI type)."""
    return mpi_ops.to_numpy(t, None).reshape(-1).view(np.uint8)


def _land(output: torch.Tensor, result, what: str = "") -> None:
    """Copy the engine's ``result`` into ``output`` unless it was made in ``output``'s memory; an error naming
    ``what`` (the collective) when the sizes differ (the ranks' inputs did not have the sizes expected)."""
    if result.size != output.numel():
        raise ValueError(f"aiacc backend: {what or 'collective'} on rank {aiacc.rank()}: the output has size "
                         f"{output.numel()}, but {result.size} elements arrived: the ranks' inputs differ in size "
                         "from what this rank expects (every rank must pass inputs of the same size)")
    if output.is_contiguous() and _made_in(mpi_ops.to_numpy(output.detach(), None), result):
        return
    with torch.no_grad():
        output.copy_(mpi_ops.from_array(_contiguous(result), output.dtype).reshape(output.shape))


def _contiguous(array):
    """``array`` in C order: numpy for host results, cupy for CUDA results (which never pass through numpy)."""
    return array_module(device_of(array)).ascontiguousarray(array)


def _made_in(mine, result) -> bool:
    """Whether the engine's ``result`` lies in the memory of ``mine`` (the output's own array)."""
    if isinstance(mine, np.ndarray) and isinstance(result, np.ndarray):
        return np.shares_memory(mine, result)
    return device_of(mine) == device_of(result) and data_ptr(mine) == data_ptr(result) \
        and mine.nbytes == result.nbytes


not_traced(AiaccProcessGroup, GroupDevices, Work, DoneWork, PointToPoint, Chain)  # (see untraced.py)


def _create(backend_opts, _pg_options):
    """torch's constructor hook (``extended_api=True``): the group's rank, size and global ranks."""
    rank, size = backend_opts.group_rank, backend_opts.group_size
    if not aiacc.is_initialized():
        aiacc.init()
    if aiacc.size() == 1 and size > 1 and not aiacc.is_enabled():
        raise RuntimeError(f"aiacc backend: torch expects {size} processes, but aiacc is switched off (AIACC_ENABLE "
                           "unset or 0) and runs this process alone; start the job with `aiaccrun -np N python ...`")
    ranks = list(backend_opts.global_ranks_in_group or range(size))
    timeout = getattr(backend_opts, "timeout", None)
    if size != aiacc.size():
        return _sub_group(ranks, rank, str(getattr(backend_opts, "group_id", "") or ""), timeout)
    if rank != aiacc.rank():
        raise ValueError(f"aiacc backend: torch's rendezvous gives this process rank {rank}, MPI gives rank "
                         f"{aiacc.rank()}; start the job with aiaccrun, which sets RANK from MPI (or leave RANK unset)")
    global _groups_made
    number, _groups_made = _groups_made, _groups_made + 1
    return AiaccProcessGroup(rank, size, aiacc.api.job_comm(), number, timeout=timeout)


_groups_made = 0  # groups over all ranks this process has made (the same sequence on every rank)


def _sub_group(ranks: List[int], rank: int, name: str, timeout=None) -> AiaccProcessGroup:
    """A group of fewer ranks than the job (torch calls this on its members only): a process set of the members
    alone (``aiacc.api.add_members_only_set``: an MPI communicator made over them by ``MPI_Comm_create_group``,
    an engine of its own negotiating among them), so the other ranks need not call anything; its operations run
    only among the members, beside the default group's and other groups' (each engine has its own thread and
    communicator). Sub-groups take no number in ``_groups_made``: ranks outside them make none. Making it waits
    at most ``timeout`` (the group's) for the other members: a member that does not call ``new_group`` is then a
    RuntimeError naming it (``MPI_Comm_create_group`` alone waited for ever)."""
    if ranks != sorted(ranks) or len(set(ranks)) != len(ranks) or not 0 <= rank < len(ranks):
        raise ValueError(f"aiacc backend: a group of ranks {ranks} with this process as its rank {rank}: aiacc "
                         "takes a group's ranks in increasing order")
    if ranks[rank] != aiacc.rank():
        raise ValueError(f"aiacc backend: torch makes this process rank {rank} of the group of ranks {ranks}, i.e. "
                         f"rank {ranks[rank]} of the job, but MPI gives it rank {aiacc.rank()}; start the job with "
                         "aiaccrun, which sets RANK from MPI (or leave RANK unset)")
    # the tag of MPI_Comm_create_group: torch gives the group the same name on every member
    seconds = seconds_of(timeout) or seconds_of(_DEFAULT_TIMEOUT)
    try:
        process_set = aiacc.api.add_members_only_set(ranks, tag=zlib.crc32(name.encode()) % 32768, timeout=seconds,
                                                     what="new_group")
    except aiacc.exceptions.MembersMissingError as exc:
        late = exc.missing
        raise RuntimeError(f"aiacc backend: Timed out waiting {round(seconds * 1000)}ms in new_group(ranks={ranks}) on "
                           f"rank {aiacc.rank()} for its members, timeout {datetime.timedelta(seconds=seconds)} (the "
                           f"group's): rank{'s' if len(late) > 1 else ''} {', '.join(map(str, late))} did not call "
                           f"new_group in time ({exc}); every member must call new_group for it (other ranks need "
                           "not)") from None
    return AiaccProcessGroup(rank, len(ranks), process_set.mpi_comm, process_set=process_set, timeout=timeout)


def register() -> None:
    """Register the ``aiacc`` backend with torch.distributed (``import aiacc.torch`` does this once)."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])
    install_monitored_barrier()
