"""aiacc.mxnet (MXNet 1.9.1) on real 2-rank (some 3-rank) jobs, against single-process references.

Few launches on purpose (every MXNet process spends seconds importing it):
one job for the collectives and the Module API, one for Gluon training
(broadcast, six optimizer setups, the buckets' timeline, the mismatch error, a failing backward),
one 3-rank job for process sets (every collective, DistributedOptimizer and DistributedTrainer
on a set), one plain process for the disabled switch, the example, and the benchmark.
"""

import json
import re
import sys

import pytest

from conftest import ROOT, WORKERS, aiaccrun, assert_ok, assert_trains_as_one_process, need_framework, python, run


need_framework("mxnet")

MX_ENV = {"MXNET_CPU_WORKER_NTHREADS": "1", "OMP_NUM_THREADS": "1"}


@pytest.mark.parametrize("ranks", [2, 3])  # 3: float16 sums of 3 rounded once, uneven reducescatter, averages by 3
def test_ndarray_collectives_module_api_and_errors_match_numpy(ranks):
    job = aiaccrun(ranks, "mx_collectives.py", env=MX_ENV, timeout=240)
    assert_ok(job, ranks)
    for r in range(ranks):
        assert f"COLLECTIVES_OK rank={r} checks=74" in job.output and f"MODULE_OK rank={r}" in job.output, job.output
        assert f"MODULE_SAME_START_OK rank={r}" in job.output, job.output
        assert len([line for line in job.lines("ERROR_OK") if f"rank={r}" in line]) == 19, job.output


def test_process_sets_on_every_collective_optimizer_and_trainer_match_numpy():
    job = aiaccrun(3, "mx_process_sets.py", env=MX_ENV, timeout=240)
    assert_ok(job, 3, checks=92)
    for r in range(3):
        set_id = 1 if r % 2 == 0 else 2  # the even ranks [0, 2], the odd rank [1]
        assert f"SET_COLLECTIVES_OK rank={r} set={set_id} checks=88" in job.output, job.output
        member = r % 2 == 0  # the optimizer and the trainer average over the even ranks; rank 1 trains alone
        assert f"OPTIMIZER_OK rank={r} member={member}" in job.output, job.output
        assert f"TRAINER_OK rank={r} member={member}" in job.output, job.output
        assert len(job.lines(f"SET_ERROR_OK rank={r} ")) == 5, job.output


def _spans(path):
    events = json.loads(path.read_text())
    tracks = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "thread_name"}
    spans = {}
    for e in events:
        if e.get("ph") == "X":
            spans.setdefault((tracks[e["tid"]], e["name"]), []).append(e["ts"])
    return {k: sorted(v) for k, v in spans.items()}


def test_static_hybridized_blocks_train_as_plain_ones_also_with_add_clipping_and_unused_children():
    """static_alloc/static_shape CachedOps keep the gradient arrays of their first backward: they are rebuilt
    once the gradients live in the buckets, so p.grad() is what backward wrote (grad_req 'write' and 'add',
    clipped before step(), a child unused every other step) and training equals the plain twin's."""
    assert_ok(aiaccrun(2, "mx_static.py", env=MX_ENV, timeout=180), 2, checks=18)


def test_distributed_trainer_matches_one_process_and_sends_buckets_during_backward(tmp_path):
    timeline = tmp_path / "mx.json"
    job = aiaccrun(2, "mx_trainer.py", env=MX_ENV, flags=["--timeline", str(timeline), "--timeline-all-ranks"],
                   timeout=300)
    assert_ok(job, 2)
    for r in range(2):
        assert f"BROADCAST_OK rank={r}" in job.output, job.output
        assert len([x for x in job.lines("TRAIN_OK") if f"rank={r}" in x]) == 7, job.output
        assert f"MISMATCH_OK rank={r}" in job.output and f"BCAST_MISMATCH_OK rank={r}" in job.output, job.output
        assert f"NAMES_OK rank={r}" in job.output, job.output  # a parameter frozen on one rank; repeated names
        assert f"BACKWARD_ERROR_OK rank={r}" in job.output, job.output  # an error, not a hang
        assert f"GLUON_OPT_OK rank={r}" in job.output, job.output  # Horovod's gluon.Trainer + DistributedOptimizer
    # the mismatch error names the tensor and what each rank had
    assert re.search(r"tensor 'grad\.mismatch_(weight|bias)'.*rank 0: \(4.*rank 1: \(5", job.output), job.output

    # Buckets: the deep model's 20 gradients travel as a few bucket requests, each exactly once per
    # step, never one request per gradient.
    steps = int(re.search(r"DEEP_OK rank=0 steps=(\d+)", job.output).group(1))
    overlapped, seen = {0: [], 1: []}, []
    for r in range(2):
        spans = _spans(timeline.with_name(f"{timeline.name}.rank{r}"))
        buckets = sorted({track for track, _ in spans if track.startswith("allreduce.bucket[grad.deep_")})
        assert len(buckets) >= 2, f"rank {r}: expected several buckets, got {buckets}"
        assert not [track for track, _ in spans if track.startswith("allreduce.grad.deep_")], "a gradient was sent on its own"
        for b in buckets:
            assert len(spans[(b, "QUEUE")]) == len(spans[(b, "ALLREDUCE")]) == steps, (b, spans[(b, "QUEUE")])
        # Overlap: the backward pass pauses 0.3 s before the input layer's gradients, so the
        # bucket that fills first must be communicated before the bucket holding the last gradient
        # is even submitted (its callback fires the moment its last gradient is final). The first
        # step settles the buckets and sends them all at its end, so it is not counted.
        for k in range(1, steps):
            queued = {b: spans[(b, "QUEUE")][k] for b in buckets}
            first, last = min(queued, key=queued.get), max(queued, key=queued.get)
            comm_first = spans[(first, "ALLREDUCE")][k]
            seen.append((r, k, comm_first, queued[last]))
            if comm_first < queued[last]:
                overlapped[r].append(k)
    assert all(overlapped.values()), (f"a rank never communicated a bucket before its last bucket was submitted "
                                      f"(rank, step, first bucket's communication, last bucket submitted): {seen}")


def test_disabled_wrappers_are_mxnet_own_bit_for_bit():
    job = python("mx_disabled.py", env=MX_ENV, timeout=180)
    assert_ok(job, 1)
    assert "TRAINER_SAME opt=sgd" in job.output and "TRAINER_SAME opt=adam" in job.output, job.output


def test_digits_example_reaches_95_percent_on_2_ranks():
    job = aiaccrun(2, str(ROOT / "examples" / "mxnet_digits.py"), env=MX_ENV, timeout=300)
    assert job.returncode == 0, job.output
    accuracies = [float(a) for a in re.findall(r"test accuracy (\d\.\d+)", job.output)]
    assert accuracies and accuracies[-1] >= 0.95, job.output


def test_digits_example_trains_as_one_process_on_3_ranks():
    """``--batch-size`` is the global batch: on 3 ranks each took 64 // 3 = 21 samples (63 a step; epoch 1 loss
    1.5896 against one process's 1.5843). Now the batch is split 22/21/21 and every rank steps with 64 / 3:
    every epoch's loss and accuracy are one process's."""
    example = str(ROOT / "examples" / "mxnet_digits.py")
    one = run([sys.executable, example, "--epochs", "3"], env=MX_ENV, timeout=180)
    many = aiaccrun(3, example, "--epochs", "3", env=MX_ENV, timeout=300)
    assert_trains_as_one_process(one, many, 3)


def test_train_benchmark_reports_aiacc_and_the_dist_sync_parameter_server():
    cmd = [sys.executable, "-m", "aiacc.launcher", "-np", "2", sys.executable, "-m", "aiacc.bench", "train",
           "--framework", "mxnet", "--model", "cnn", "--batch-size", "8", "--steps", "2", "--warmup", "1",
           "--repeats", "1", "--json"]
    job = run(cmd, env=MX_ENV, timeout=300)
    assert job.returncode == 0, job.output
    rows = [json.loads(line) for line in job.output.splitlines() if line.startswith("{")]
    assert [row["impl"] for row in rows] == ["aiacc", "aiacc-no-overlap", "ps-dist_sync"], job.output
    assert all(row["samples/s"] > 0 and row["compute ms"] > 0 and row["ranks"] == 2 for row in rows), rows
    assert rows[2]["settings"].startswith("parameter server"), rows


def test_trainer_steps_keep_no_memory_per_step():
    """3000 DistributedTrainer steps after 1000 to warm up: resident memory grows by a few bytes per step at most
    (with UCX's mmap hooks, which aiacc now turns off before MPI loads, ~155 B per step for good)."""
    job = aiaccrun(2, "mx_memory.py", "3000", env=MX_ENV, timeout=180)
    assert_ok(job, 2)
    grown = [float(v) for v in re.findall(r"grown=(-?[\d.]+)", job.output)]
    assert len(grown) == 2 and max(grown) < 50, f"bytes kept per step, per rank: {grown}\n{job.output}"


@pytest.mark.parametrize("ranks", [2, 3])
def test_broadcast_parameters_of_different_names_is_an_error_naming_them_not_a_hang(ranks):
    """Ranks whose dicts differ by name get one TensorMismatchError naming the parameters and the ranks (before:
    each rank waited for the other's broadcasts until the stall shutdown, 30 minutes by default; 20 s here). At 3
    ranks a name that ranks 1 and 2 have is named with both (it read "only rank 1 has 'b'; only rank 2 has 'b'")."""
    job = aiaccrun(ranks, "mx_broadcast_names.py", env={**MX_ENV, "AIACC_STALL_SHUTDOWN_SECONDS": "20"}, timeout=180)
    assert_ok(job, ranks)


def test_trainer_parameters_unused_on_some_ranks_train_as_one_process():
    """A parameter only some ranks' backward reached: zeros from the others, updated on every rank (before: the
    stale rank sent its old gradient and skipped the update, so the ranks drifted apart); unused everywhere:
    skipped (ignore_stale_grad) or gluon's UserWarning on every rank. Also with grad_req='add' and
    allreduce_grads() + update(), with float16 gradients and with fp16 compression. The ranks' flags travel in
    a bucket sent anyway: each step after the first is one allreduce request and one collective per bucket
    (before: one more of each, the flags' own). Ranks whose parameters differ by name get the buckets' error, no
    wait (20 s stall shutdown here: a regression fails instead of hanging)."""
    env = {**MX_ENV, "AIACC_STALL_SHUTDOWN_SECONDS": "20"}
    assert_ok(aiaccrun(2, "mx_stale.py", env=env, timeout=180), 2, checks=175)


@pytest.mark.parametrize("ranks", [2, 3])
def test_trainer_gluon_patterns_clipping_stale_multi_precision_checkpoint_static_add_match_one_process(ranks, tmp_path):
    """allreduce_grads() + clip_global_norm + update(): the clip sees the ranks' sum, as one process (with per-rank
    batch sizes) and Horovod (before: the average, so clipped steps differed); ignore_stale_grad with
    set_learning_rate; multi_precision float32 master weights; save_states/load_states on every rank; a static
    hybridized block with grad_req='add', two passes and p.zero_grad(), and grad_req='add' never zeroed: each
    equals one process on the whole batch."""
    assert_ok(aiaccrun(ranks, "mx_patterns.py", str(tmp_path), env=MX_ENV, timeout=180), ranks, checks=10)


def test_numpy_semantics_trainer_keeps_numpy_gradients_and_matches_one_process():
    """Under npx.set_np() every Parameter.grad() stays an mx.np.ndarray once it lives in a bucket (before: a legacy
    NDArray, which MXNet's numpy operators refuse), and training equals one process on the whole batch; the
    collectives answer mx.np.ndarrays with mx.np.ndarrays."""
    assert_ok(aiaccrun(2, "mx_numpy.py", env=MX_ENV, timeout=180), 2, checks=31)


def test_a_script_that_imports_mxnet_first_runs_unchanged_under_python_m_aiacc_mxnet():
    """MXNet 1.9.1 needs numpy.bool (gone in numpy 1.24..1.26), which importing aiacc.mxnet restores: a script that
    imports mxnet first (Horovod's examples do) failed at that line, and there was no way to run it unchanged.
    ``aiaccrun -np 2 python -m aiacc.mxnet SCRIPT ARGS`` runs it as ``python SCRIPT ARGS`` would (its argv, its
    directory on sys.path, as __main__), and its trainer step averages the ranks' gradients."""
    import numpy  # noqa: PLC0415

    script = str(WORKERS / "mx_mxnet_first.py")
    launch = [sys.executable, "-m", "aiacc.launcher", "-np", "2", sys.executable]
    job = run([*launch, "-m", "aiacc.mxnet", script, "--lr", "0.5"], env=MX_ENV, timeout=120)
    assert_ok(job, 2)
    if "1.24.0" <= numpy.lib.NumpyVersion(numpy.__version__) < "2.0.0":  # (before 1.24, from 2.0 numpy.bool exists)
        plain = run([*launch, script, "--lr", "0.5"], env=MX_ENV, timeout=120)
        assert plain.returncode != 0 and "module 'numpy' has no attribute 'bool'" in plain.output, plain.output
