"""Error cases: each must end (never hang) and say what was wrong, on every rank involved.

Usage: errors.py CASE
"""

import os
import signal
import sys
import time

import numpy as np

import aiacc
from report import raises, say

case = sys.argv[1]


def expect(exc_type, fn, *words):
    text = raises(exc_type, fn, *words)
    say(f"ERROR-SEEN rank={aiacc.rank() if aiacc.is_initialized() else 0}: {text}")
    return text


if case == "before_init":
    expect(aiacc.NotInitializedError, lambda: aiacc.allreduce(np.ones(2)), "aiacc.allreduce() was called before aiacc.init()")
    expect(aiacc.NotInitializedError, lambda: aiacc.rank(), "aiacc.rank() was called before aiacc.init()")
    # (these named the aiacc.rank() they call)
    expect(aiacc.NotInitializedError, lambda: aiacc.broadcast_object(1), "aiacc.broadcast_object() was called before")
    expect(aiacc.NotInitializedError, lambda: aiacc.allgather_object(1), "aiacc.allgather_object() was called before")
    aiacc.init()
    aiacc.shutdown()  # (not "before init()" now: after shutdown(), and init() again works)
    expect(aiacc.NotInitializedError, lambda: aiacc.allreduce(np.ones(2)),
           "aiacc.allreduce() was called after aiacc.shutdown(); call aiacc.init() again first")
    aiacc.init()
    assert aiacc.allreduce(np.ones(2), name="again").tolist() == [1.0, 1.0]
    aiacc.shutdown()
    say("OK rank=0")
    sys.exit(0)

if case == "mixed_setting":  # VAR VALUE SHOWN: VAR set on rank 1 only, before init(): every rank refuses to start
    variable, value, shown = sys.argv[2:5]
    if os.environ.get("PMI_RANK") == "1":
        os.environ[variable] = value
    # (rank 0's value marked as its default: it read as if rank 0 had been given it)
    expect(aiacc.ConfigError, aiacc.init, "the ranks were given different values of", variable, "(the default); rank 1",
           f"rank 1: {shown})")
    expect(aiacc.NotInitializedError, lambda: aiacc.rank(), "before aiacc.init()")  # (nothing half-started)
    sys.exit(0)

aiacc.init()
r, n = aiacc.rank(), aiacc.size()


def still_works():
    got = aiacc.allreduce(np.array([1.0]), op=aiacc.Sum, name="after.error")
    assert got[0] == n, got


if case == "shape":
    x = np.ones((2, 3) if r != 1 else (3, 2), np.float32)
    expect(aiacc.TensorMismatchError, lambda: aiacc.allreduce(x, name="weights"),
           "'weights'", "shape", "rank 1: (3, 2)", "(2, 3)")
    # synchronize_all raises the failed handle's error only after the others have finished
    handles = [aiacc.allreduce_async(x, name="weights.again"), aiacc.allreduce_async(np.ones(2), name="fine")]
    raises(aiacc.TensorMismatchError, lambda: aiacc.synchronize_all(handles), "'weights.again'", "shape")
    assert handles[1].done() and (handles[1].wait() == 1).all()
    assert (aiacc.synchronize_all([aiacc.allreduce_async(np.full(2, r), op=aiacc.Sum, name="sum")])[0]
            == sum(range(n))).all()
    still_works()
elif case == "adasum_ranks_and_dtype":  # at 3 ranks: Adasum needs a power of 2, and floating-point tensors
    # an int32 tensor: both named at once (the number of ranks alone was named; at 4 ranks then the dtype)
    expect(TypeError, lambda: aiacc.allreduce(np.ones(4, np.int32), op=aiacc.Adasum, name="counts"),
           "tensor 'counts' with op=Adasum", "not int32", "power-of-2 number of ranks only, not 3")
    # a float32 tensor: the number of ranks only
    expect(NotImplementedError, lambda: aiacc.allreduce(np.ones(4, np.float32), op=aiacc.Adasum, name="grads"),
           "tensor 'grads' with op=Adasum", "Adasum runs on a power-of-2 number of ranks, not 3")
    still_works()
elif case == "dtype":
    x = np.ones(4, np.float32 if r != 1 else np.float64)
    expect(aiacc.TensorMismatchError, lambda: aiacc.allreduce(x, name="bias"), "'bias'", "dtype", "rank 1: float64")
    still_works()
elif case == "op":
    expect(aiacc.TensorMismatchError,
           lambda: aiacc.allreduce(np.ones(4), op=aiacc.Sum if r == 0 else aiacc.Max, name="loss"),
           "'loss'", "reduce op", "rank 0: Sum", "Max")
    still_works()
elif case == "kind":
    fn = (lambda: aiacc.allreduce(np.ones(4), name="t")) if r == 0 else (lambda: aiacc.allgather(np.ones(4), name="t"))
    expect(aiacc.TensorMismatchError, fn, "'t'", "operation", "rank 0: allreduce", "allgather")
elif case == "root":
    def ranks(first):  # as the message names the ranks from ``first`` in steps of 2
        group = list(range(first, n, 2))
        return ("rank " if len(group) == 1 else "ranks ") + ",".join(map(str, group))
    expect(aiacc.TensorMismatchError, lambda: aiacc.broadcast(np.ones(2), root_rank=r % 2, name="params"),
           "'params'", "root rank", f"{ranks(0)}: 0; {ranks(1)}: 1")
elif case == "shape_after_cache":
    for step in range(3):
        aiacc.allreduce(np.ones(5), name="cached")  # agreed, then served from the cache
    x = np.ones(5 if r == 0 else 6)
    expect(aiacc.TensorMismatchError, lambda: aiacc.allreduce(x, name="cached"), "'cached'", "shape",
           "rank 0: (5,)", ("rank 1" if n == 2 else "ranks " + ",".join(str(k) for k in range(1, n))) + ": (6,)")
    still_works()
elif case == "duplicate":
    # rank 0 submits each name twice before the others submit it: they wait for rank 0's 'go' first, so its first
    # one cannot finish, and the second meets it in flight (by order, not by a sleep)
    BUCKET = "bucket[grad.2.bias..grad.0.weight]"
    if r == 0:
        h, hb = aiacc.allreduce_async(np.ones(3), name="dup"), aiacc.allreduce_async(np.ones(3), name=BUCKET)
        expect(aiacc.DuplicateNameError, lambda: aiacc.allreduce_async(np.ones(3), name="dup"),
               "'dup'", "rank 0", "still in flight")
        # a gradient bucket's: two optimizer wrappers with the same parameter names (a GAN's), said how to mend
        expect(aiacc.DuplicateNameError, lambda: aiacc.allreduce_async(np.ones(3), name=BUCKET),
               "two optimizer wrappers whose parameters have the same names",
               "named_parameters=G.named_parameters(prefix='G')")
    aiacc.broadcast(np.zeros(1), 0, name="go")
    if r != 0:
        h, hb = aiacc.allreduce_async(np.ones(3), name="dup"), aiacc.allreduce_async(np.ones(3), name=BUCKET)
    assert (aiacc.synchronize(h) == 1).all() and (aiacc.synchronize(hb) == 1).all()
    still_works()
elif case == "root_range":
    expect(ValueError, lambda: aiacc.broadcast(np.ones(2), root_rank=n + 3, name="w"),
           "'w'", f"root_rank={n + 3}", "out of range", f"0..{n - 1}")
    # a bool is refused as no rank at all (it was "root_rank=True is out of range ... (valid: 0..1)", though True == 1)
    for root in (True, False):
        text = expect(ValueError, lambda: aiacc.broadcast(np.ones(2), root_rank=root, name="flag"), "'flag'",
                      f"root_rank={root} is a bool, not a rank")
        assert "out of range" not in text, text
    still_works()
elif case == "bad_arrays":
    expect(TypeError, lambda: aiacc.allreduce(np.ones(3, np.clongdouble), name="cplx"), "'cplx'", "complex256",
           "not support")
    expect(ValueError, lambda: aiacc.allreduce(np.ones((4, 4))[:, 1], name="strided"), "'strided'",
           "not C-contiguous")
    expect(ValueError, lambda: aiacc.alltoall(np.ones(5), splits=[1, 1, 1][:n], name="splits"), "'splits'",
           "splits")
    # in a group, the tensor at fault is named by its place (it was only the group's name: which of 100 gradients?)
    expect(ValueError, lambda: aiacc.grouped_allreduce([np.ones(2), np.ones((4, 4))[:, 1]], name="grp"),
           "tensor 1 of group 'grp' is not C-contiguous")
    expect(TypeError, lambda: aiacc.grouped_allgather([np.ones(2), np.ones(2), np.ones(2, np.clongdouble)], name="grp2"),
           "tensor 2 of group 'grp2' has dtype complex256")
    # argument errors are ValueErrors and, like every error of a collective, AiaccErrors (RuntimeErrors)
    expect(aiacc.InvalidArgumentError, lambda: aiacc.alltoall(np.ones(n), splits=np.ones(n, np.float32),
                                                              name="fsplits"), "'fsplits'", "integer dtype", "float32")
    expect(RuntimeError, lambda: aiacc.alltoall(np.ones(n + 1), name="uneven"), "'uneven'", "not divisible")
    expect(aiacc.InvalidArgumentError, lambda: aiacc.reducescatter(np.float32(1), name="scalar"), "'scalar'",
           "at least one dimension")
    # in place into a read-only array (used to end the job from inside the engine: MPI refuses the buffer)
    frozen = np.ones(3, np.float32)
    frozen.flags.writeable = False
    for call in (lambda: aiacc.allreduce_(frozen, name="frozen"),
                 lambda: aiacc.synchronize(aiacc.allreduce_async_(frozen, op=aiacc.Sum, name="frozen")),
                 lambda: aiacc.grouped_allreduce_([np.ones(2), frozen], name="frozen")):
        expect(ValueError, call, "tensor 'frozen' is a read-only array", "pass a writeable array")
    # ... which an out-of-place call reads as any other
    assert (aiacc.allreduce(frozen, op=aiacc.Sum, name="frozen.read") == n).all()
    # a list or tuple of numbers is one array, as numpy reads it (it was taken as a group of scalars: a broadcast
    # of [1.0, r] returned array(1.0)); in place, it has nowhere to take the result
    assert aiacc.allreduce([1.0, 2.0], op=aiacc.Sum, name="as.list").tolist() == [n, 2 * n]
    assert aiacc.broadcast((1.0, float(r)), 0, name="as.tuple").tolist() == [1.0, 0.0]
    assert aiacc.allgather([r, r], name="as.rows").tolist() == [q for q in range(n) for _ in (0, 1)]
    expect(TypeError, lambda: aiacc.allreduce_([1.0, 2.0], name="listed"), "tensor 'listed'", "got list",
           "returns a new array")
    # a list of arrays of different shapes is no array: numpy's bare "inhomogeneous shape" named neither the call nor
    # the tensor; the error now does, and points at the grouped call
    expect(ValueError, lambda: aiacc.allreduce([np.ones(2), np.ones(3)], name="ragged"),
           "allreduce of tensor 'ragged': a list of arrays of different shapes", "grouped_allreduce")
    expect(ValueError, lambda: aiacc.broadcast([np.ones(2), np.ones(3)], 0, name="ragged"),
           "broadcast of tensor 'ragged': a list of arrays of different shapes")
    # one array given to a grouped call was taken as the list of its rows (a list of 0-d results came back)
    for call in (aiacc.grouped_allreduce, aiacc.grouped_allreduce_, aiacc.grouped_allgather,
                 aiacc.grouped_reducescatter):
        expect(TypeError, lambda: call(np.ones((3, 2)), name="one"),
               f"{call.__name__} of 'one' takes a list of arrays, not one array",
               f"{call.__name__.replace('grouped_', '')}(array)")
    # a numpy scalar (what arithmetic on a 0-d array returns) was "has shape () and dtype float32; expected ()
    # and float32"
    expect(TypeError, lambda: aiacc.allreduce_(np.float32(2.0), name="scalar"), "tensor 'scalar'",
           "got a numpy scalar (float32), not an array")
    # a scale factor that is not a finite number (a NaN was reported as differing across ranks: NaN != NaN), a
    # priority that is not a number (float()'s message named neither)
    expect(aiacc.InvalidArgumentError, lambda: aiacc.allreduce(np.ones(2), prescale_factor=float("nan"),
                                                               name="nan.scale"), "prescale_factor=nan is not a finite")
    expect(aiacc.InvalidArgumentError, lambda: aiacc.grouped_allreduce([np.ones(2)], postscale_factor=float("inf"),
                                                                       name="inf.scale"), "postscale_factor=inf")
    expect(TypeError, lambda: aiacc.allreduce_async_(np.ones(2), priority="high", name="prio"),
           "tensor 'prio': priority='high' is not a number")
    # a scale factor given as a string was taken (float("2") is 2.0); Horovod's refuses it
    expect(TypeError, lambda: aiacc.allreduce(np.ones(2), prescale_factor="2", name="str.scale"),
           "tensor 'str.scale': prescale_factor='2' is not a number")
    # another byte order: refused by name (the dtype's name alone, float32, read as if it were supported)
    expect(TypeError, lambda: aiacc.allreduce(np.ones(2, ">f4"), name="swapped"), "'swapped'",
           "non-native byte order ('>f4')", "newbyteorder('=')")
    still_works()
elif case == "str_names":
    # names that are str subclasses (numpy's str_, read from an array of names) are the same names as plain str:
    # they were refused as "name='w' must be a string, not str_"; rank 0 passes them, the others plain str
    class Label(str):
        pass

    names = np.array(["w", "g", "ag", "bc", "rs", "a2a"])
    name = (lambda i: names[i]) if r == 0 else (lambda i: str(names[i]))
    assert (aiacc.allreduce(np.ones(2), op=aiacc.Sum, name=name(0)) == n).all()
    inplace = np.ones(3)
    assert aiacc.synchronize(aiacc.allreduce_async_(inplace, op=aiacc.Sum, name=name(0))) is inplace
    assert (inplace == n).all()
    assert (aiacc.grouped_allreduce([np.ones(1)], op=aiacc.Sum, name=name(1))[0] == n).all()
    assert aiacc.allgather(np.full(1, r), name=name(2)).tolist() == list(range(n))
    assert aiacc.broadcast(np.full(1, r), 1, name=name(3)).tolist() == [1]
    assert aiacc.reducescatter(np.ones((n, 1)), op=aiacc.Sum, name=name(4)).tolist() == [[n]]
    assert aiacc.alltoall(np.full(n, r), name=name(5)).tolist() == list(range(n))
    assert aiacc.allreduce(np.ones(1), op=aiacc.Sum, name=Label("labelled") if r == 0 else "labelled")[0] == n
    # a name that is no string at all is still refused, naming it
    expect(TypeError, lambda: aiacc.allreduce(np.ones(2), name=3), "name=3 must be a string, not int")
    still_works()
elif case == "unpickle_elsewhere":
    # rank 0 sends an object of a module only it can import (another code version, a path set on one rank): the
    # other ranks' pickle.loads raised a bare "No module named 'only_on_rank0'", naming neither the call nor the rank
    import tempfile

    if r == 0:
        where = tempfile.mkdtemp()
        with open(os.path.join(where, "only_on_rank0.py"), "w") as f:
            f.write("class Thing:\n    value = 3\n")
        sys.path.insert(0, where)
        import only_on_rank0

        thing = only_on_rank0.Thing()
        assert aiacc.broadcast_object(thing, 0, name="thing") is thing
    else:
        expect(ValueError, lambda: aiacc.broadcast_object(None, 0, name="thing"),
               "broadcast_object 'thing': the object of rank 0 cannot be unpickled on rank " + str(r),
               "No module named 'only_on_rank0'")
    mine = thing if r == 0 else r
    if r == 0:  # (rank 0 can load every rank's object)
        assert aiacc.allgather_object(mine, name="things")[1:] == list(range(1, n))
    else:
        expect(ValueError, lambda: aiacc.allgather_object(mine, name="things"),
               "allgather_object 'things': the object of rank 0 cannot be unpickled on rank " + str(r),
               "No module named 'only_on_rank0'")
    still_works()
elif case == "uncaught":
    # rank 1 fails while rank 0 waits in a collective: the whole job must end with the message.
    if r == 1:
        time.sleep(0.5)
        raise RuntimeError("boom on rank 1")
    aiacc.allreduce(np.ones(3), name="never.completes")
    time.sleep(60)
elif case == "rank_dies":
    if r == 1:
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    aiacc.allreduce(np.ones(3), name="never.completes")
    time.sleep(60)
elif case == "stall_warn":
    # rank 1 is late by 3 s; the inspector (1 s) warns naming the tensor and the missing rank.
    if r == 1:
        time.sleep(3)
    got = aiacc.allreduce(np.ones(2), op=aiacc.Sum, name="late.tensor")
    assert (got == n).all()
elif case == "stall_shutdown":
    # rank 0 waits for 'only.on.rank0'; the others wait for 'only.on.others': nobody can ever finish.
    # The others submit 1 s later, so their tensor is younger than the limit when rank 0's
    # passes it: the error must still name both (every tensor some rank is stuck on).
    name = "only.on.rank0" if r == 0 else "only.on.others"
    if r != 0:
        time.sleep(1.0)
    # (the message names the variable the user set: Horovod's when only that one is)
    variable = ("AIACC_STALL_SHUTDOWN_SECONDS" if "AIACC_STALL_SHUTDOWN_SECONDS" in os.environ
                else "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS")
    text = expect(aiacc.StallError, lambda: aiacc.allreduce(np.ones(2), name=name), f"({variable})",
                  "'only.on.rank0'", "missing on ranks [" + ", ".join(str(k) for k in range(1, n)) + "]",
                  "'only.on.others'", "missing on ranks [0]")
    expect(aiacc.ShutdownError, lambda: aiacc.allreduce(np.ones(2), name="after"), "cannot submit")
elif case == "stall_in_set":
    # ranks 1 and 2 wait in their process set for tensors of the same names the global set uses: the warning and
    # the error say which set (they read as if the job's ranks were stuck, beside a global set that works)
    pair = aiacc.add_process_set([1, 2])
    if r in (1, 2):
        expect(aiacc.StallError, lambda: aiacc.allreduce(np.ones(2), name="x" if r == 1 else "y", process_set=pair),
               "in the process set of ranks [1, 2]", "'x': submitted", "still missing on ranks [2]")
    from mpi4py import MPI

    MPI.COMM_WORLD.Barrier()  # (rank 0 waits outside aiacc: no tensor of its own stalls meanwhile)
    assert (aiacc.allreduce(np.ones(2), op=aiacc.Sum, name="x") == n).all()  # the global set goes on
elif case == "stall_off":
    # the stall inspector switched off (Horovod's --no-stall-check): rank 1, 6 s late, is waited for whatever
    # shutdown time is set (2 s here), and no warning is printed
    if r == 1:
        time.sleep(6)
    got = aiacc.allreduce(np.ones(2), op=aiacc.Sum, name="late.tensor")
    assert (got == n).all()
elif case == "stall_shutdown_busy_rank":
    # rank 1 is busy elsewhere (not in aiacc); rank 0's stall error ends the whole job.
    if r == 1:
        time.sleep(120)
    aiacc.allreduce(np.ones(2), name="waits.forever")
elif case == "tape_names_differ":
    # the ranks name their DistributedGradientTapes apart (rank 0 "tape0", rank 1 "tape1"): the first steps of their
    # gradient buckets wait for each other (sets named by the tape's name; ranks whose variables differ under one
    # name get the error at once, see tf_mismatch.py). At the first stall check (AIACC_STALL_CHECK_SECONDS),
    # not at the stall shutdown, every rank gets the error naming both sets and the ranks in each.
    import tensorflow as tf
    import aiacc.tensorflow as hvd
    w, b = tf.Variable(tf.ones([3]), name="w"), tf.Variable(tf.ones([2]), name="b")
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(w * w) + tf.reduce_sum(b)
    tape = hvd.DistributedGradientTape(tape, name=f"tape{r}")
    expect(aiacc.TensorMismatchError, lambda: tape.gradient(loss, [w, b]),
           "set up gradient buckets for different lists of gradients", "the same parameters, in the same order",
           ", ".join(f"ranks [{k}] in 'aiacc.buckets.tape{k}'" for k in range(n)))  # (at 3 ranks: all three sets)
    expect(aiacc.ShutdownError, lambda: aiacc.allreduce(np.ones(2), name="after"), "cannot submit")
elif case == "shutdown_mid_flight":
    if r == 0:
        aiacc.shutdown()
        say("OK rank=0")
        sys.exit(0)
    expect(aiacc.ShutdownError, lambda: aiacc.allreduce(np.ones(2), name="orphan"), "'orphan'", "shut down by rank 0")
else:
    raise SystemExit(f"unknown case {case}")
say(f"OK rank={r}")
