"""aiacc.tensorflow and aiacc.keras on real 2-rank jobs (TensorFlow 2.21, Keras 3).

TensorFlow takes seconds to import, so each job checks many things (see the worker docstrings).
"""

import collections
import json
import re
import sys
from pathlib import Path
from typing import List, NamedTuple

import pytest

from conftest import TENSORFLOW, ROOT, aiaccrun, assert_ok, assert_trains_as_one_process, need_framework, python, run

need_framework("tensorflow", TENSORFLOW)
need_framework("keras")

TF_TIMEOUT = 280
# for the jobs that count the collectives of every step: the same-start check adds one at the second step
# (tests/test_same_start.py)
SAME_START_OFF = {"AIACC_CHECK_SAME_START": "0"}


def test_collectives_gradients_sparse_zero_copy_and_errors_eager_and_in_tf_function():
    assert_ok(aiaccrun(2, "tf_ops.py", timeout=TF_TIMEOUT), 2, checks=194)  # (32 of them complex64 / complex128)


def test_horovod_api_graphs_in_any_order_error_classes_process_sets_local_sources_and_elastic_state():
    """Collectives created in a different order on each rank, more than TensorFlow has threads, in a Session
    and in tf.function: no hang (the job's timeout), results against numpy; the rest of Horovod's API."""
    assert_ok(aiaccrun(2, "tf_horovod.py", timeout=TF_TIMEOUT), 2, checks=295)


@pytest.mark.parametrize("mode", ["v2", "v1", "ref"])
def test_tf1_optimizer_backward_passes_per_step_accumulates_and_applies_every_nth_run(mode):
    """TF1's DistributedOptimizer with backward_passes_per_step in a TF1 graph (resource variables and control flow
    v2; TF1's own; reference variables under control flow v2, whose update TF2's cond cannot build): Horovod's
    aggregation test, momentum against numpy, a local variable, the same-start check at the second reduction;
    eagerly a NotImplementedError naming what to use."""
    assert_ok(aiaccrun(2, "tf1_aggregation.py", mode, timeout=TF_TIMEOUT), 2, checks=30 if mode == "v1" else 31)


class BucketStep(NamedTuple):
    """One training step of one rank, from its timeline (times in µs)."""
    order: List[str]      # bucket names in the order the buckets were handed to the engine
    last_submit: float    # when the last of them was handed over
    first_comm: float     # when the communication of the first of them began


def _bucket_steps(path, prefix, steps) -> List[BucketStep]:
    """Per training step, how the gradient buckets of the gradients ``prefix.*`` of one rank went to the
    engine; every bucket must have gone exactly once per step."""
    events = json.loads(path.read_text())
    tracks = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "thread_name"}
    spans = collections.defaultdict(lambda: collections.defaultdict(list))
    for e in events:
        if e.get("ph") == "X" and tracks.get(e["tid"], "").startswith(f"allreduce.bucket[{prefix}."):
            spans[tracks[e["tid"]]][e["name"]].append(e["ts"])
    assert spans, f"no bucket of {prefix}.* in {path}: {sorted(set(tracks.values()))}"
    requests = {name: len(phases["QUEUE"]) for name, phases in spans.items()}
    assert all(n == steps for n in requests.values()), f"requests per bucket in {steps} steps: {requests}"
    out = []
    for k in range(steps):
        order = sorted(spans, key=lambda name: spans[name]["QUEUE"][k])
        out.append(BucketStep(order, spans[order[-1]]["QUEUE"][k], spans[order[0]]["ALLREDUCE"][k]))
    return out


def _first_index(bucket: str) -> int:
    """``allreduce.bucket[overlap.17.bias..overlap.14.kernel]`` -> 17: where its gradients are in the variable list."""
    return int(bucket.split("[", 1)[1].split(".")[1])


OVERLAP_STEPS = 10


def test_custom_loop_matches_one_process_and_sends_buckets_while_backprop_runs(tmp_path):
    timeline = tmp_path / "loop.json"
    # 1 MiB buckets: each hidden layer's 1 MiB kernel closes one, so the timeline model has several
    job = aiaccrun(2, "tf_loop.py", str(OVERLAP_STEPS), timeout=TF_TIMEOUT,
                   env={"AIACC_TIMELINE": str(timeline), "AIACC_TIMELINE_ALL_RANKS": "1", "AIACC_BUCKET_CAP": "1MiB"})
    assert_ok(job, 2)
    for rank in range(2):
        # one request per bucket per step (the first step too, whose wait settles the buckets)
        steps = _bucket_steps(tmp_path / f"loop.json.rank{rank}", "overlap", OVERLAP_STEPS)
        assert len(steps[0].order) >= 4, f"rank {rank}: expected several buckets, got {steps[0].order}"
        # Every step hands the buckets over in the order backprop fills them, the last layers' first (the
        # control edges of aiacc.tensorflow._ordering make this certain, whatever the executor prefers).
        backprop_order = sorted(steps[0].order, key=lambda name: -_first_index(name))
        for k, step in enumerate(steps):
            assert step.order == backprop_order, f"rank {rank} step {k}: {step.order}"
        # Overlap: the first bucket was already being communicated before the last one (the first
        # layers') had been handed over, i.e. while this rank's backprop still ran. Not counted: the first
        # step, whose buckets are settled only in its wait.
        later = steps[1:]
        overlapped = [s for s in later if s.first_comm < s.last_submit]
        table = "\n".join(f"  step {k + 1}: the first bucket's communication began "
                          f"{(s.last_submit - s.first_comm) / 1e3:.1f} ms before the last was handed over"
                          for k, s in enumerate(later))
        assert len(overlapped) > len(later) / 2, f"rank {rank}: too few steps overlapped:\n{table}"


def test_ranks_with_different_variables_fail_at_once_naming_what_differs():
    """DistributedGradientTape (eager, tf.function, with an IndexedSlices gradient), broadcast_variables and
    Keras fit over a variable more, a sublist or another shape on one rank: every rank gets the error naming
    each rank's count (or the shape) at once. Before, the ranks waited for each other until the stall check
    (here 600 s, so only the new checks can end the job within the timeout), or rank 0 went on."""
    job = aiaccrun(2, "tf_mismatch.py", timeout=TF_TIMEOUT, env={"AIACC_STALL_CHECK_SECONDS": "600"})
    assert_ok(job, 2, checks=18)


def test_model_fit_with_distributed_optimizer_and_callbacks():
    """... and ranks whose fit has different numbers of batches or epochs: an error naming each rank's from the
    broadcast and metric callbacks (the rank with fewer went on, and the others stalled for ever in a reduction)."""
    assert_ok(aiaccrun(2, "tf_fit.py", timeout=TF_TIMEOUT), 2, checks=12)


def test_keras_resume_from_a_plain_keras_checkpoint_and_registered_custom_optimizers():
    """Horovod's resume pattern with a checkpoint plain Keras wrote: the broadcast callback used to wait forever
    (tensors named after optimizer variables, which Keras names per process) and hvd.load_model gave Keras'
    built-in Adam back unwrapped; a registered custom optimizer came back unwrapped, and saved wrapped it could
    not be loaded by keras.models.load_model; a LossScaleOptimizer given to compile came back wrapped around its
    wrapped inner optimizer (every step reduced twice; refused with backward_passes_per_step=2); plain
    keras.models.load_model then fit with the callbacks trained each rank alone without a word (now a warning)."""
    assert_ok(aiaccrun(2, "keras_load.py", timeout=TF_TIMEOUT), 2, checks=lambda k: 16 if k == 0 else 13)


def test_keras_gradient_accumulation_reduces_once_per_update_and_equals_plain_keras():
    assert_ok(aiaccrun(2, "keras_accumulation.py", timeout=TF_TIMEOUT, env=SAME_START_OFF), 2, checks=20)


def test_keras_adamw_excluded_variables_stay_excluded_from_weight_decay_and_equal_plain_keras():
    """exclude_from_weight_decay() lives outside get_config(): the wrapper rebuilt from the config decayed the
    excluded variables (before), away from plain Keras on the whole batch."""
    assert_ok(aiaccrun(2, "keras_weight_decay.py", timeout=TF_TIMEOUT, env=SAME_START_OFF), 2, checks=4)


@pytest.mark.parametrize("backend", ["tensorflow", "jax", "torch"])
def test_keras_steps_per_execution_trains_equal_to_plain_keras_and_reduces_once_per_step(backend):
    """model.compile(..., steps_per_execution=N) was untested: on TensorFlow and JAX fit with the callbacks, Adam, a
    shorter last call and backward_passes_per_step=2 equals plain Keras with the same N, with one reduction per step
    (per update), not per call; on torch Keras refuses N > 1 when fit starts, on every rank."""
    if backend != "tensorflow":
        need_framework(backend)
    job = aiaccrun(2, "keras_steps_per_execution.py", env={"KERAS_BACKEND": backend, **SAME_START_OFF},
                   timeout=TF_TIMEOUT)
    assert_ok(job, 2, checks=1 if backend == "torch" else 9)


@pytest.mark.parametrize("backend", ["tensorflow", "torch"])
def test_terminate_on_nan_on_one_rank_ends_fit_on_every_rank(backend):
    """keras.callbacks.TerminateOnNaN stopped the rank whose batch held a NaN a step before the others: under
    MetricAverageCallback the job stalled for ever (Horovod's too); now every rank's fit returns."""
    if backend != "tensorflow":
        need_framework(backend)
    job = aiaccrun(2, "keras_terminate_on_nan.py", env={"KERAS_BACKEND": backend}, timeout=TF_TIMEOUT)
    assert_ok(job, 2, checks=3)


@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_keras_on_the_torch_and_jax_backends_trains_equal_to_plain_keras_on_the_whole_batch(backend):
    """KERAS_BACKEND=torch / jax: fit with DistributedOptimizer and the callbacks, backward_passes_per_step, op=Sum,
    a process set and a local variable, against plain Keras on the same backend; a mismatch named, by apply, by
    fit (on JAX fit returned without a word, its weights the failed step's error) and by broadcast_variables.
    jit_compile=True too (on torch, dynamo traced the reduction into the engine and failed on every rank)."""
    need_framework(backend)
    job = aiaccrun(2, "keras_other_backend.py", env={"KERAS_BACKEND": backend, **SAME_START_OFF},
                   timeout=TF_TIMEOUT)
    assert_ok(job, 2, checks=16)


def test_keras_on_jax_reaches_aiacc_through_an_xla_call_that_keeps_jax_fast_dispatch_and_equals_io_callback():
    """KERAS_BACKEND=jax: the compiled step's calls into aiacc (reduction, finite check, same-start check) are an XLA
    custom call; io_callback, which they were, made JAX dispatch every step in Python (~28 us per variable). Results
    for several dtypes and an error's type and message as with io_callback (still the fallback), JAX's Python
    executor not run after the first call (it is, every call, with io_callback), fit trains the same weights."""
    need_framework("jax")
    job = aiaccrun(2, "jax_host_call.py", env={"KERAS_BACKEND": "jax"}, timeout=TF_TIMEOUT)
    assert_ok(job, 2, checks=10)


def test_keras_on_jax_without_a_compiler_warns_once_and_trains_through_io_callback(tmp_path):
    """A machine with no C++ compiler (PATH: only the venv's bin; an empty home and temporary directory, so no
    library built before): each rank says once that the XLA call could not be built and why, and Keras' JAX steps
    go through io_callback: fit runs, and the same-start check still warns about the forgotten broadcast."""
    need_framework("jax")
    (tmp_path / "tmp").mkdir()
    job = aiaccrun(2, "same_start_keras.py", "none", timeout=TF_TIMEOUT,
                   env={"KERAS_BACKEND": "jax", "HOME": str(tmp_path), "TMPDIR": str(tmp_path / "tmp"),
                        "PATH": str(Path(sys.executable).parent)})
    assert_ok(job, 2)
    assert job.output.count("aiacc.keras: the XLA call into aiacc could not be built (") == 2, job.output
    assert "no C++ compiler (c++, g++ or clang++) on PATH" in job.output, job.output
    assert "jax.experimental.io_callback instead" in job.output, job.output
    assert job.output.count("DistributedOptimizer: the ranks do not train the same model") == 2, job.output


def test_keras_on_torch_sends_gradient_buckets_during_backward_and_trains_equal_to_plain_keras():
    """KERAS_BACKEND=torch: every gradient went to the engine after backward() had returned, as one grouped allreduce
    in apply. Now the hooks hand each to its bucket as autograd makes it: every bucket but the last (it carries the
    flags apply sets) is submitted before the step's last gradient exists, once per step, with nothing else reduced;
    fit, op=Sum, fp16, mixed_float16 and custom loops whose apply() gets other gradients (changed in place, after a
    second backward, torch.autograd.grad's) or None (on every rank, or on one: it was a TensorMismatchError) all
    end with plain Keras' weights."""
    need_framework("torch")
    job = aiaccrun(2, "keras_torch_overlap.py", env={"KERAS_BACKEND": "torch", "AIACC_BUCKET_CAP": "1024", **SAME_START_OFF},
                   timeout=TF_TIMEOUT)
    assert_ok(job, 2, checks=13)


def test_a_layer_used_on_some_ranks_only_trains_as_one_process():
    """A gradient None on some ranks only (a layer called on rank 0 alone), DistributedGradientTape eagerly and
    model.fit (run eagerly) with a train_step that branches on the rank, with Adam: equal to one process whose loss
    has that layer's output on rank 0's rows only, in the first step and after steps where every rank or no rank
    used it; in tf.function (None-ness fixed at trace time) the layer on every rank or on none, and a function that
    rank 1 alone retraces, equal one process, and the layer on rank 0 only is an error on rank 1 naming it (see
    tf_presence.py). Before: an error on every rank in the first step, and in a later step a wait for the rank
    without it (the stall shutdown below ends such a job); in tf.function rank 1 went on silently without rank 0's
    update; an IndexedSlices gradient on rank 0 and None on rank 1 is an error naming it (it waited for ever)."""
    job = aiaccrun(2, "tf_presence.py", timeout=TF_TIMEOUT,
                   env={"AIACC_STALL_CHECK_SECONDS": "20", "AIACC_STALL_SHUTDOWN_SECONDS": "60"})
    assert_ok(job, 2, checks=5)


def test_an_embedding_or_a_cast_gradient_none_on_one_rank_in_a_later_step_trains_as_one_process():
    """An embedding's IndexedSlices gradient that every rank had in earlier steps and rank 1 has None of later,
    DistributedGradientTape eagerly and Keras' DistributedOptimizer in a custom loop: equal to one process (Adam),
    every rank gets the same IndexedSlices average; in tf.function None everywhere stays None, and None on rank 1
    only is an error there naming the embedding and the rank while rank 0 applies the average; a float16 gradient
    of a float32 variable (cast by the user) None on rank 1 later, equal to one process (tf_presence_later.py).
    An embedding that no rank looked up in the first step (its None went in a dense bucket), then on rank 0 only:
    eagerly (tape, Keras optimizer) equal to one process, in tf.function rank 1's error naming it; the embedding on
    rank 0 only in the first step (before: an error on every rank), likewise.
    Before: each of them waited until the stall shutdown below ended the job."""
    job = aiaccrun(2, "tf_presence_later.py", timeout=TF_TIMEOUT,
                   env={"AIACC_STALL_CHECK_SECONDS": "20", "AIACC_STALL_SHUTDOWN_SECONDS": "60"})
    assert_ok(job, 2, checks=13)


def test_variables_that_change_at_a_later_step_train_as_one_process_on_every_rank_and_fail_at_once_on_one():
    """The list of variables a reduction differentiates changes after its first steps (a head added, a layer frozen,
    unfrozen): on every rank at once, DistributedGradientTape eagerly and in tf.function and model.fit with Keras'
    DistributedOptimizer (a layer frozen and unfrozen with trainable + compile between fits) train as one process, and
    once the change's step is done a step sends the allreduces it sent before; a persistent tape asked for two lists
    every step sends the same allreduces in every step after the first. On rank 1 only (a head added eagerly, a layer
    frozen in tf.function or between fits, a dense layer left out beside an embedding): an error on every rank naming
    rank 1 as the one that changed, rank 0, and the gradients only one rank has (tf_later_change.py). Before: each
    change on one rank waited until the stall shutdown below ended the job."""
    job = aiaccrun(2, "tf_later_change.py", timeout=TF_TIMEOUT,  # (counts every step's allreduces: SAME_START_OFF)
                   env={"AIACC_STALL_CHECK_SECONDS": "20", "AIACC_STALL_SHUTDOWN_SECONDS": "60", **SAME_START_OFF})
    assert_ok(job, 2, checks=8)


def test_an_embedding_no_rank_looks_up_costs_nothing_on_the_wire_and_trains_as_one_process():
    """A 4096 x 64 embedding table (1 MiB) that no rank looks up, beside a Dense layer: after the first such step its
    None sends fewer than 1 KiB in allreduces per step and no rows in allgathers (DistributedGradientTape eagerly,
    tf.function); then looked up by rank 0 only, by none, densely (one_hot @ table) by rank 0 only, by every rank,
    by none: equal to one process with Adam and with SGD momentum (None everywhere: not stepped), also with Keras'
    DistributedOptimizer (tf_unused_sparse.py). Before: its zeros, 1,048,736 bytes, went in its bucket every step."""
    job = aiaccrun(2, "tf_unused_sparse.py", timeout=TF_TIMEOUT,
                   env={"AIACC_STALL_CHECK_SECONDS": "20", "AIACC_STALL_SHUTDOWN_SECONDS": "60"})
    assert_ok(job, 2, checks=8)


def test_a_gradient_whose_kind_or_dtype_differs_across_ranks_trains_as_one_process():
    """An embedding table looked up densely (one_hot @ table) on some ranks and with tf.gather (IndexedSlices) on
    others, changing per step after a first step dense on every rank, DistributedGradientTape eagerly and in
    tf.function and Keras' DistributedOptimizer: equal to one process (Adam), every rank gets the same gradient.
    Float16 gradients of float32 variables (cast by the user) None on rank 1 in the first step: equal to one process
    eagerly; in tf.function rank 1's error naming it while rank 0 applies the average, and the later steps run. A
    new cast dtype on one rank only in a later step: equal to one process, the ranks bit-equal (tf_kinds.py).
    Before: a kind that changed on one rank crashed (TypeError) or waited until the stall shutdown below, a new
    dtype on one rank waited until it, and the first-step cast was a dtype mismatch error on every rank."""
    job = aiaccrun(2, "tf_kinds.py", timeout=TF_TIMEOUT,
                   env={"AIACC_STALL_CHECK_SECONDS": "20", "AIACC_STALL_SHUTDOWN_SECONDS": "60"})
    assert_ok(job, 2, checks=6)


@pytest.mark.parametrize("ranks", [2, 3])
def test_a_gradient_dense_on_some_ranks_and_indexed_slices_on_others_in_the_first_step_trains_as_one_process(ranks):
    """The same table dense on some ranks and IndexedSlices (or None) on others from the FIRST step on: the tape
    eagerly (Adam, SGD) and in tf.function, Keras' DistributedOptimizer in a loop and model.fit (Adam, SGD) equal one
    process on the global batch; a table of another shape on one rank is still an error on every rank naming it, its
    shapes and the ranks (tf_kinds_first.py). Before: "in the first step of a reduction every rank must compute the
    same kinds of gradients" on every rank."""
    job = aiaccrun(ranks, "tf_kinds_first.py", timeout=TF_TIMEOUT,
                   env={"AIACC_STALL_CHECK_SECONDS": "20", "AIACC_STALL_SHUTDOWN_SECONDS": "60"})
    assert_ok(job, ranks, checks=7)


def test_a_rank_whose_gradients_are_all_indexed_slices_trains_as_one_process_and_tables_must_match():
    """A model that is only an embedding table, looked up with tf.gather (all IndexedSlices, no bucket) on rank 0 and
    densely or not at all on rank 1 from the first step on: the tape eagerly and in tf.function, Keras'
    DistributedOptimizer in a loop and model.fit equal one process on the global batch. Tables IndexedSlices on every
    rank but of other shapes under one name: an error on every rank naming the variable, both shapes and the ranks;
    of the same shape: no allreduce after the first step (tf_sparse_only.py). Before: the first waited until the stall
    shutdown below; the tables of other row counts crashed rank 0 in unsorted_segment_sum and gave rank 1 the
    gradient of another table."""
    job = aiaccrun(2, "tf_sparse_only.py", timeout=TF_TIMEOUT,
                   env={"AIACC_STALL_CHECK_SECONDS": "20", "AIACC_STALL_SHUTDOWN_SECONDS": "60", **SAME_START_OFF})
    assert_ok(job, 2, checks=10)


def test_gradients_of_a_shape_unknown_on_some_rank_in_the_first_step_train_as_one_process_or_fail_on_every_rank():
    """tf_first_unknown.py: a table tf.Variable(shape=[None, 2]) and a watched tensor of a tf.function input [None, 2],
    gathered on rank 0 and looked up densely ((6, 2) when traced) on rank 1, train as one process (before: "shape
    differs across ranks (rank 0: (*, 2); rank 1: (6, 2))"); known sizes that differ are still an error naming the
    shapes and ranks. A rank with no bucket (its gradients None of a variable of unknown shape, or dense of a shape
    unknown while traced) joins the first step's collective: an error on every rank naming the gradient and what it
    is on that rank, where before both waited until the stall shutdown below; later steps send nothing more."""
    job = aiaccrun(2, "tf_first_unknown.py", timeout=TF_TIMEOUT,
                   env={"AIACC_STALL_CHECK_SECONDS": "20", "AIACC_STALL_SHUTDOWN_SECONDS": "60", **SAME_START_OFF})
    assert_ok(job, 2, checks=6)


def test_a_layer_used_on_some_ranks_only_keras_on_torch_trains_as_one_process():
    """KERAS_BACKEND=torch: model.fit whose call() branches on the rank (Keras' torch trainer hands apply() None for the
    layer rank 1 did not call) equals one process, as on TensorFlow (the torch buckets' flags already did this)."""
    need_framework("torch")
    job = aiaccrun(2, "tf_presence.py", env={"KERAS_BACKEND": "torch", "AIACC_STALL_SHUTDOWN_SECONDS": "60"},
                   timeout=TF_TIMEOUT)
    assert_ok(job, 2, checks=1)


def test_variables_keras_numbered_differently_on_the_ranks_are_matched_by_place():
    """A custom layer's add_weight() without a name: Keras numbers the name per process ('variable' on rank 0,
    'variable_2' on rank 1, which made such variables first). DistributedGradientTape and model.fit failed on
    this valid job ("gradient 0 has different names across ranks"), and op=Adasum waited for ever (each rank
    reduced the gradient under its own name). Now they equal the average / plain Keras on the whole batch."""
    job = aiaccrun(2, "tf_auto_names.py", timeout=TF_TIMEOUT, env={"AIACC_STALL_CHECK_SECONDS": "600"})
    assert_ok(job, 2, checks=4)


def test_training_patterns_unused_and_frozen_layers_gans_and_clipping_train_as_one_process():
    """Users' patterns, each equal to one process on the whole batch (see tf_patterns.py): a layer not called on
    some steps (None gradients: Adam and momentum leave it alone, as in one process), a layer frozen and
    unfrozen, GANs (two tapes, a persistent tape, two DistributedOptimizers in a train_step), clipping by global
    norm, clipnorm and global_clipnorm (of the averaged gradient), dict sources. UnconnectedGradients.ZERO over a
    Keras model's variables failed ("'str' object has no attribute '_type_enum'"); now it gives zeros, and a layer
    called on one rank only gets the average of its gradient and the other's zeros."""
    assert_ok(aiaccrun(2, "tf_patterns.py", timeout=TF_TIMEOUT), 2, checks=17)


def test_keras_on_torch_gradients_that_differ_across_ranks_are_named_by_variable():
    """KERAS_BACKEND=torch, another layer width on one rank (or a gradient one rank lacks): under
    backward_passes_per_step or op=Adasum the error named a gradient by its place in a group only ("tensor
    'DistributedOptimizer.gradients' (entry 0 of the group)", "number of tensors differs"); now, on every path, as
    on the TensorFlow backend ('<name>.0.kernel'), with each rank's Keras path of the variable."""
    need_framework("torch")
    job = aiaccrun(2, "keras_torch_mismatch.py", env={"KERAS_BACKEND": "torch", "AIACC_STALL_CHECK_SECONDS": "600"},
                   timeout=TF_TIMEOUT)
    assert_ok(job, 2, checks=7)


@pytest.mark.parametrize("backend", ["tensorflow", "torch", "jax"])
def test_keras_collectives_take_horovods_keras_arguments_and_give_the_backends_tensors(backend):
    """aiacc.keras' allreduce(value, name, average, ...) and reducescatter(value, name, op) in Horovod's Keras
    order (a positional average=False sums); on PyTorch / JAX the backend's tensors in and out (a torch tensor
    that requires grad, a Keras variable) for every collective; broadcast_ assigns Keras variables."""
    if backend != "tensorflow":
        need_framework(backend)
    job = aiaccrun(2, "keras_collectives.py", env={"KERAS_BACKEND": backend}, timeout=TF_TIMEOUT)
    assert_ok(job, 2, checks={"tensorflow": 22, "torch": 24, "jax": 23}[backend])


@pytest.mark.parametrize("backend", ["tensorflow", "torch", "jax"])
def test_keras_mixed_float16_skips_a_step_that_overflows_on_one_rank_on_every_rank(backend):
    """Keras' mixed_float16 policy (compile's LossScaleOptimizer around DistributedOptimizer, and the other order
    by hand): an overflow on rank 1 only skips that step everywhere and halves every rank's loss scale, as plain
    Keras on the whole batch does. Before, rank 0 waited in the reduction rank 1 skipped (a stall, or on a later
    step a reduction of different steps' gradients); the stall settings end such a job with an error. With
    backward_passes_per_step=2 as Keras' gradient_accumulation_steps=2 (on JAX, before, the loss-scale
    optimizer's skip branch failed to trace: the wrapper's bookkeeping had put the model's variables among the
    optimizer's); backward_passes_per_step around a LossScaleOptimizer refused with what to do instead."""
    if backend != "tensorflow":
        need_framework(backend)
    job = aiaccrun(2, "keras_loss_scale.py", timeout=TF_TIMEOUT,
                   env={"KERAS_BACKEND": backend, "AIACC_STALL_CHECK_SECONDS": "5", "AIACC_STALL_SHUTDOWN_SECONDS": "30"})
    assert_ok(job, 2, checks=10)


def test_keras_on_a_backend_without_reduction_is_refused_by_name(monkeypatch):
    """Keras' NumPy backend (inference only): Keras' backend query answers "numpy" for this check of the
    refusal's message (a job on it would have nothing to train)."""
    import keras

    from aiacc.tensorflow.keras._optimizer import check_backend

    monkeypatch.setattr(keras.backend, "backend", lambda: "numpy")
    with pytest.raises(NotImplementedError, match="DistributedOptimizer: Keras runs on the 'numpy' backend"):
        check_backend("DistributedOptimizer")


@pytest.mark.parametrize("make,message", [
    (lambda cb: cb.LearningRateWarmupCallback(initial_lr=None), "LearningRateWarmupCallback: initial_lr is required"),
    (lambda cb: cb.LearningRateWarmupCallback(initial_lr="fast"),
     "LearningRateWarmupCallback: initial_lr must be a number, got 'fast'"),
    (lambda cb: cb.LearningRateScheduleCallback(0.1, multiplier=None),
     r"LearningRateScheduleCallback: multiplier \(a number or a function of the epoch\) is required"),
])
def test_a_learning_rate_callback_without_its_rate_names_the_argument(make, message):
    # (float(None)'s TypeError named no argument; Horovod's: "Parameter `initial_lr` is required")
    import aiacc.keras.callbacks as cb

    with pytest.raises(ValueError, match=message):
        make(cb)


def test_disabled_returns_the_users_objects_and_changes_nothing():
    assert_ok(python("tf_disabled.py", timeout=TF_TIMEOUT), 1)


@pytest.mark.parametrize("example,backend", [("tensorflow_digits.py", "tensorflow"), ("keras_digits.py", "tensorflow"),
                                             ("keras_digits.py", "torch"), ("keras_digits.py", "jax")])
def test_example_reaches_95_percent_on_2_ranks(example, backend):
    """The Keras example runs unchanged on Keras' PyTorch and JAX backends too."""
    job = run([sys.executable, "-m", "aiacc.launcher", "-np", "2", sys.executable, str(ROOT / "examples" / example)],
              env={"KERAS_BACKEND": backend}, timeout=TF_TIMEOUT)
    assert job.returncode == 0, job.output
    accuracies = [float(a) for a in re.findall(r"test accuracy (\d\.\d+)", job.output)]
    assert accuracies and accuracies[-1] >= 0.95, job.output
    if example == "keras_digits.py":
        assert f"ranks (Keras on {backend})" in job.output, job.output


def test_tensorflow_example_trains_as_one_process_on_3_ranks():
    """``--batch-size`` is the global batch: on 3 ranks each took 64 // 3 = 21 samples (63 a step; epoch 1 loss
    1.0078 against one process's 1.0159). Now the batch is split 22/21/21 and each rank's loss is its sum over
    64 / 3: every epoch's loss and accuracy are one process's."""
    example = str(ROOT / "examples" / "tensorflow_digits.py")
    one = run([sys.executable, example, "--epochs", "3"], timeout=TF_TIMEOUT)
    many = aiaccrun(3, example, "--epochs", "3", timeout=TF_TIMEOUT)
    assert_trains_as_one_process(one, many, 3)


def test_keras_example_runs_on_a_rank_count_that_does_not_divide_the_data():
    """1347 training samples over 6 ranks: shards of 225 and 224 made fit run 8 steps an epoch on some
    ranks and 7 on others, which the callbacks refuse; the example gives every rank the same share."""
    job = run([sys.executable, "-m", "aiacc.launcher", "-np", "6", sys.executable,
               str(ROOT / "examples" / "keras_digits.py"), "--epochs", "1"], timeout=TF_TIMEOUT)
    assert job.returncode == 0, job.output
    assert "test accuracy" in job.output and "on 6 ranks" in job.output, job.output


def test_train_benchmark_prints_aiacc_and_multi_worker_mirrored_strategy():
    job = run([sys.executable, "-m", "aiacc.launcher", "-np", "2", sys.executable, "-m", "aiacc.bench", "train",
               "--framework", "tensorflow", "--model", "transformer", "--steps", "1", "--warmup", "1",
               "--repeats", "1", "--json"], timeout=TF_TIMEOUT)
    assert job.returncode == 0, job.output
    records = [json.loads(line) for line in job.output.splitlines() if line.startswith("{")]
    assert [r["impl"] for r in records] == ["aiacc", "tf-mwms", "aiacc-blocking"], job.output
    assert "do not train the same model" not in job.output, job.output  # one model again after the compute steps
    for r in records:
        assert r["ranks"] == 2 and r["samples/s"] > 0 and r["compute ms"] > 0 and r["params"] == 525834, r
        assert r["vs tf-mwms"] == pytest.approx(r["samples/s"] / records[1]["samples/s"]), r
        if r["impl"] != "tf-mwms":  # its steps ran engine cycles, on whichever thread
            assert r["cycle cpu ms"] > 0, r


def test_gradient_tape_and_keras_optimizer_average_over_a_process_set():
    job = aiaccrun(3, "tf_process_sets.py", timeout=TF_TIMEOUT)
    assert_ok(job, 3, checks=6)  # 2 modes x 2 gradients, the optimizer, then unnamed tapes on overlapping sets


@pytest.mark.parametrize("ranks", [2, 3])
def test_sync_batch_normalization_equals_one_batch_normalization_over_the_global_batch(ranks):
    """Outputs, input gradients, gamma/beta gradients (summed over ranks) and moving statistics of
    hvd.SyncBatchNormalization equal one keras BatchNormalization over the global batch (uneven batches,
    eager and tf.function)."""
    assert_ok(aiaccrun(ranks, "tf_sync_bn.py", timeout=TF_TIMEOUT), ranks, checks=93)


def test_a_savedmodel_with_aiacc_ops_loaded_elsewhere_fails_naming_the_cause(tmp_path):
    # the loading process had registered its own aiacc op under the saved op's key: the saved Average
    # ran that op instead and returned 3 x the sum, silently
    where = str(tmp_path / "model")
    assert_ok(aiaccrun(1, "tf_savedmodel.py", "save", where, timeout=TF_TIMEOUT), 1, marker="SAVED")
    job = aiaccrun(1, "tf_savedmodel.py", "load", where, timeout=TF_TIMEOUT)
    assert "RESULT" not in job.output, job.output
    assert "ERROR-SEEN rank=0" in job.output and "aiacc collectives traced in another process" in job.output, job.output


def test_keras_resnet50_with_l2_regularizers_trains():
    """TensorFlow refused Horovod's ImageNet recipe (ResNet50 + L2 regularizers) with "nodes in a cycle": the
    edges that order aiacc's submits held a filter gradient's ShapeN back behind its own layer's bias gradient,
    which oneDNN then fused with the filter gradient."""
    assert_ok(aiaccrun(1, "keras_resnet_l2.py", timeout=TF_TIMEOUT), 1, checks=2)


def test_tf_function_training_keeps_no_memory_per_step():
    """4000 tf.function steps through DistributedGradientTape after 1500 to warm up: resident memory grows by a
    few bytes per step at most. With UCX's mmap hooks (the mpich wheel's default, which aiacc now turns off before
    MPI loads) every step kept ~270-280 B for good (0.3 GB per million steps)."""
    job = aiaccrun(2, "tf_memory.py", "4000", timeout=TF_TIMEOUT)
    assert_ok(job, 2)
    grown = [float(v) for v in re.findall(r"grown=(-?[\d.]+)", job.output)]
    assert len(grown) == 2 and max(grown) < 50, f"bytes kept per step, per rank: {grown}\n{job.output}"


def test_keras2_scripts_under_tf_use_legacy_keras():
    """Keras 2 (``tf.keras`` is the tf_keras package with TF_USE_LEGACY_KERAS=1, how Keras 2 scripts run on a
    current TensorFlow): model.fit with the new and the legacy optimizers and Horovod's callbacks, a tf.function
    loop with backward_passes_per_step, local layers and SyncBatchNormalization equal one process on the global batch.
    Before, every Keras 2 optimizer was refused ("needs a Keras 3 optimizer") and the callbacks failed in fit.
    hvd.load_model of a Keras 2 .keras or .h5 file (new and legacy optimizers) gives the optimizer back wrapped, its
    saved state in it, and goes on as one process; before, it was Keras 3's load_model, which cannot read a Keras 2
    model's file. LearningRateWarmupCallback's momentum_correction scales a legacy optimizer's momentum per batch as
    Horovod's does; before, it only warned (and claimed Keras 3)."""
    need_framework("tf_keras")
    assert_ok(aiaccrun(2, "keras2.py", env={"TF_USE_LEGACY_KERAS": "1"}, timeout=TF_TIMEOUT), 2, checks=33)
