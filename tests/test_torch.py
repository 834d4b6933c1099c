"""aiacc.torch on real 2-rank (some 3-rank) jobs: Horovod's API, training equal to one process, overlap, the switch."""

import importlib.util
import json
import re
import sys

import pytest

from conftest import ROOT, aiaccrun, assert_ok, need_framework, python, run

need_framework("torch")


@pytest.mark.parametrize("ranks", [2, 3])  # 3: averages by 3, uneven shards, joins and errors that group ranks
def test_collectives_autograd_broadcasts_and_misuse_errors(ranks):
    job = aiaccrun(ranks, "torch_api.py", timeout=180)
    assert_ok(job, ranks, checks=245 + ranks)  # (one check a broadcast root)
    others = "rank 1" if ranks == 2 else "ranks " + ",".join(str(k) for k in range(1, ranks))
    for words in (
        "was computed more than backward_passes_per_step=1 times before step()",
        "duplicate parameter name 'x'",
        "named_parameters does not cover parameters of the optimizer: param_groups[0]['params'][2] (shape (3, 6))",
        f"tensor 'Parameter.0.weight': shape differs across ranks (rank 0: (6, 4); {others}: (7, 4))",
        f"tensor 'grad.0.weight': shape differs across ranks (rank 0: (6, 4); {others}: (7, 4))",
        "add_param_group() was called after backward() and before step()",
    ):
        for r in range(ranks):  # every rank gets the error, none hangs
            seen = [line for line in job.lines(f"ERROR-SEEN rank={r}: ") if words in line]
            assert seen, f"rank {r} did not report {words!r}:\n{job.output}"


def _bucket_steps(path, prefix):
    """Per step: (start of the first 'ALLREDUCE', start of the last 'QUEUE') over the buckets whose
    track names start with ``prefix``, and the number of those buckets."""
    events = json.loads(path.read_text())
    names = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "thread_name"}
    phases = {}
    for e in events:
        if e.get("ph") == "X" and names[e["tid"]].startswith(prefix):
            phases.setdefault(names[e["tid"]], {}).setdefault(e["name"], []).append(e["ts"])
    counts = {len(p["QUEUE"]) for p in phases.values()} | {len(p["ALLREDUCE"]) for p in phases.values()}
    assert counts == {8}, (counts, sorted(phases))  # one allreduce per bucket per step, none per tensor
    steps = []
    for k in range(8):
        first_comm = min(sorted(p["ALLREDUCE"])[k] for p in phases.values())
        last_submit = max(sorted(p["QUEUE"])[k] for p in phases.values())
        steps.append((first_comm, last_submit))
    return steps, len(phases)


def test_training_equals_one_process_on_the_whole_batch_and_overlaps_backward(tmp_path):
    timeline = tmp_path / "train.json"
    job = aiaccrun(2, "torch_train.py", flags=["--timeline", str(timeline)], env={"AIACC_BUCKET_CAP": "64KiB"},
                   timeout=240)
    assert_ok(job, 2)
    for kind in ("sgd", "adam"):
        for passes in (1, 2):
            assert job.lines(f"MATCH rank=0 {kind} backward_passes_per_step={passes}"), job.output
    assert job.lines("FP16 rank=0"), job.output
    assert job.lines("UNUSED rank=1"), job.output  # rank 1 never used the branch, and still matched
    # Buckets fill in the order backward produced the gradients in the first step (autograd computes a
    # convolution's weight gradient before its bias'): the dense layers first (the first bucket closes
    # at the 64 KiB cap, after the big weight), then the convolutions.
    assert "BUCKETS rank=0 [['grad.tl.9.bias', 'grad.tl.9.weight', 'grad.tl.7.bias', 'grad.tl.7.weight'], " \
           "['grad.tl.2.weight', 'grad.tl.2.bias', 'grad.tl.0.weight', 'grad.tl.0.bias']]" in job.output, job.output
    # The timeline of rank 0: in some step, the first bucket was already on the wire before the last
    # bucket of that step (the first layers') had been produced by backward and submitted.
    steps, buckets = _bucket_steps(timeline, "allreduce.bucket[grad.tl.")
    assert buckets == 2, buckets
    overlapped = [k for k, (first_comm, last_submit) in enumerate(steps) if first_comm < last_submit]
    assert overlapped, f"no step overlapped communication with backward: {steps}"


def test_start_and_stop_timeline_under_horovods_dynamic_timeline(tmp_path):
    job = aiaccrun(2, "timeline_dynamic.py", str(tmp_path), env={"HOROVOD_TIMELINE": "DYNAMIC"})
    assert_ok(job, 2, checks=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["first.json", "link", "queued.json", "second.json"]  # no file named DYNAMIC


def test_switch_off_returns_the_users_optimizer_and_collectives_return_inputs():
    assert_ok(python("torch_disabled.py"), 1)
    assert_ok(python("torch_disabled.py", env={"AIACC_ENABLE": "0"}), 1)


def test_digits_example_reaches_95_percent_on_2_ranks():
    job = run([sys.executable, "-m", "aiacc.launcher", "-np", "2", sys.executable,
               str(ROOT / "examples" / "pytorch_digits.py")], timeout=120)
    assert job.returncode == 0, job.output
    accuracies = [float(a) for a in re.findall(r"test accuracy (\d\.\d+)", job.output)]
    assert len(accuracies) == 15 and "on 2 ranks" in job.output, job.output
    assert accuracies[-1] >= 0.95, job.output


def test_train_benchmark_and_synthetic_example_print_their_figures():
    job = run([sys.executable, "-m", "aiacc.launcher", "-np", "2", sys.executable, "-m", "aiacc.bench", "train",
               "--framework", "torch", "--model", "transformer", "--batch-size", "4", "--steps", "2",
               "--warmup", "1", "--repeats", "1", "--json"], timeout=120)
    assert job.returncode == 0, job.output
    rows = [json.loads(line) for line in job.output.splitlines() if line.startswith("{")]
    horovod = ["horovod"] if importlib.util.find_spec("horovod") else []  # where tools/build_horovod.sh ran
    assert [r["impl"] for r in rows] == ["aiacc", "aiacc-tuned", "aiacc+fwd", "ddp", "ddp-tuned"] + horovod, job.output
    settings = {r["impl"]: r["settings"] for r in rows}
    assert settings["ddp"] == settings["aiacc"] == "defaults", settings
    assert settings["ddp-tuned"].startswith("gradient_as_bucket_view=True bucket_cap_mb="), settings
    assert settings["aiacc-tuned"].startswith("bucket_cap_mb="), settings
    by_impl = {r["impl"]: r for r in rows}
    for r in rows:  # every ratio is the ratio of the samples/s printed beside it
        assert r["vs ddp"] == pytest.approx(r["samples/s"] / by_impl["ddp"]["samples/s"]), r
        assert r["vs ddp-tuned"] == pytest.approx(r["samples/s"] / by_impl["ddp-tuned"]["samples/s"]), r
    assert "averaged again" not in job.output, job.output
    for r in rows:
        assert r["samples/s"] > 0 and r["step ms"] > 0 and r["compute ms"] > 0 and r["params"] == 525834, r
        # every step ran engine cycles (on the engine thread or a waiting training thread); DDP's and Horovod's
        # column is their communication's process CPU, as their engine column
        if r["impl"].startswith("aiacc"):
            assert r["cycle cpu ms"] > 0, r
        else:
            assert r["cycle cpu ms"] == r["engine cpu ms"] == r["comm cpu ms"], r
    job = run([sys.executable, "-m", "aiacc.launcher", "-np", "2", sys.executable,
               str(ROOT / "examples" / "pytorch_synthetic_benchmark.py"), "--model", "cnn", "--batch-size", "2",
               "--num-warmup-batches", "1", "--num-batches-per-iter", "1", "--num-iters", "2"], timeout=120)
    assert job.returncode == 0, job.output
    assert re.search(r"Total img/sec on 2 CPU\(s\): \d+\.\d", job.output), job.output


def test_overlap_forward_gives_exactly_the_plain_results_with_partitions_and_priorities():
    job = aiaccrun(2, "torch_overlap.py", env={"AIACC_PARTITION_BYTES": "2KiB", "AIACC_CREDIT_BYTES": "4KiB"},
                   timeout=240)
    assert_ok(job, 2)
    assert "ERROR-SEEN rank=1: parameter 'free." in job.output and "was used before its deferred update" in job.output


def test_broadcast_parameters_before_init_names_itself():
    # (it said "aiacc.size() was called before aiacc.init()", a call the user never made)
    code = ("import torch, aiacc.torch as hvd\nm = torch.nn.Linear(2, 2)\n"
            "for f in (lambda: hvd.broadcast_parameters(m.state_dict(), 0), lambda: hvd.broadcast_optimizer_state("
            "torch.optim.SGD(m.parameters(), lr=0.1), 0)):\n"
            "    try:\n        f()\n    except ValueError as e:\n        print('ERROR', e)\n")
    job = run([sys.executable, "-c", code], timeout=120)
    assert "ERROR broadcast_parameters was called before aiacc.init()" in job.output, job.output
    assert "ERROR broadcast_optimizer_state was called before aiacc.init()" in job.output, job.output

@pytest.mark.parametrize("ranks", [2, 3])
def test_torch_distributed_backend_runs_collectives_ddp_zero_and_fsdp_equal_to_one_process(ranks):
    """dist.init_process_group("aiacc") under aiaccrun (no MASTER_ADDR set by the user): every collective and
    ReduceOp, reduce / gather / scatter to every root, async work with futures, send/recv, two groups over the
    same ranks interleaved differently on each rank, errors that say what, and DDP (also with a comm hook and
    bucket views, two DDPs on two groups in one backward, under Join with find_unused_parameters, whose joined rank
    calls the group's short form allreduce(tensor); static_graph, find_unused_parameters with a branch one rank
    takes, no_sync(), allreduce_hook: as DDP over gloo in the same job), ZeroRedundancyOptimizer and FSDP2 training
    equal to one process on the whole batch."""
    job = aiaccrun(ranks, "torch_backend.py", timeout=240)
    assert_ok(job, ranks, checks=119 + 9 * ranks)


def test_torch_sub_groups_run_among_their_members_only_beside_other_groups():
    """dist.new_group([0, 2]) at 3 ranks (refused before, as aiacc's process sets were registered by every rank
    while torch builds a sub-group's backend on its members only): every collective on it equals the reference from
    the members' data while rank 1 runs its own group of one and a default-group all_reduce is in flight; DDP over
    the sub-group (and over [1]) and aiacc's SyncBatchNorm over it train to one process on the members' batch;
    new_subgroups, new_subgroups_by_enumeration, use_local_synchronization=True; destroy_process_group(g) stops its
    engine, and a member that uses a group another member destroyed gets an error naming it, no hang."""
    assert_ok(aiaccrun(3, "torch_subgroups.py", timeout=240), 3, checks=38)


@pytest.mark.parametrize("ranks", [2, 3])
def test_tensor_parallel_dtensor_and_functional_collectives_on_the_backend_equal_one_process_and_gloo(ranks):
    """parallelize_module with ColwiseParallel / RowwiseParallel over init_device_mesh("cpu", (n,)) on the aiacc
    backend trains (SGD with momentum, 3 steps) to the parameters of one process on the full model and of the same
    run over a gloo mesh in the job; compiled (aot_eager) as eager. DTensor's distribute_tensor, redistribute (Shard
    to Replicate and Shard(1), Partial to Replicate and Shard) and full_tensor for float32, bfloat16 and int64 rows
    that do not divide among the ranks, and the functional collectives (eager and compiled) equal their references
    and run on the aiacc group (its operation counts grow)."""
    assert_ok(aiaccrun(ranks, "torch_parallel.py", "tp", timeout=180), ranks, checks=39)


def test_destroying_a_process_group_ends_its_collectives_in_flight_first():
    """dist.destroy_process_group() with an all_reduce never waited for, on the default group and on a further group
    over every rank: it ran later on the job's engine, writing into the script's tensor after the group was gone
    (a buffer reused meanwhile was overwritten); now it ends first, its result in the tensor, as over gloo."""
    assert_ok(aiaccrun(2, "torch_backend_destroy.py", timeout=120), 2, checks=4)


def test_pipeline_schedules_batch_isend_irecv_and_monitored_barrier_on_the_backend():
    """2 pipeline stages on 2 ranks (PipelineStage with ScheduleGPipe and Schedule1F1B, pipeline() with a split point,
    4 microbatches): each microbatch's loss and every gradient equal one process's. batch_isend_irecv of two tensors
    each way. dist.monitored_barrier, which torch refused on every backend but gloo ("only implemented for GLOO
    backend"), passes; with rank 1 late past a 1 s timeout, rank 0 gets a RuntimeError naming rank 1 (as gloo words
    it), and the group goes on once rank 1 comes."""
    assert_ok(aiaccrun(2, "torch_parallel.py", "pp", timeout=180), 2, checks=lambda r: 18 + 4 * r)


@pytest.mark.parametrize("ranks", [2, 3])
def test_distributed_checkpoint_of_fsdp2_saves_loads_and_trains_on_as_uninterrupted(ranks, tmp_path):
    """dcp.save of an FSDP2 model and its Adam state (get_state_dict) after 3 steps, dcp.load + set_state_dict into a
    fresh model with other parameters: every parameter and optimizer state value equals the saved one, and 3 more
    steps end where 6 uninterrupted steps do. dcp.async_save (refused before: "A CPU backend must be enabled for
    async save", as the group reported no devices), loaded into a plain model; set_model_state_dict with
    broadcast_from_rank0 (IndexError before); a model made on the meta device loaded by dcp; a full state dict
    gathered on rank 0."""
    job = aiaccrun(ranks, "torch_parallel.py", "dcp", str(tmp_path), timeout=180)
    assert_ok(job, ranks, checks=lambda r: 36 if r == 0 else 32)


def test_a_collective_a_rank_never_joins_raises_after_the_groups_timeout_and_the_job_ends():
    """Groups made with timeout=3 s; rank 1 skips an all_reduce on one: rank 0's wait on its future (as DDP waits)
    raises RuntimeError naming the operation, the group, the timeout and rank 1, the group is unusable after it,
    the default group goes on; rank 0's synchronous all_reduce on another group that rank 1 (asleep) skips raises,
    uncaught, and the job ends with a non-zero status. Before, the timeouts were ignored: rank 0 waited (for the
    stall inspector's 30 minutes)."""
    job = aiaccrun(2, "torch_timeouts.py", "group", timeout=150)
    assert job.returncode != 0, job.output
    assert "CHECKED rank=0 checks=6" in job.output and "CHECKED rank=1 checks=4" in job.output, job.output
    assert len(job.lines("ERROR-SEEN rank=0: ")) == 2, job.output
    assert "RuntimeError: aiacc backend: Timed out waiting 3000ms for allreduce (operation 'c10d.g2.allreduce.1') on " \
           "rank 0 of the process group '2' of ranks [0, 1], timeout 0:00:03 (the timeout of the process group): " \
           "rank 1 has not joined it (rank 0 did)" in job.output, job.output
    assert "aiacc: unhandled RuntimeError on rank 0; aborting all 2 ranks" in job.output, job.output
    assert "NOT-RAISED" not in job.output and "WOKE" not in job.output, job.output


def test_work_wait_with_a_timeout_raises_naming_the_missing_rank_and_the_operation_still_completes():
    """work.wait(timeout=2 s) on an all_reduce rank 1 has not joined raises naming work.wait, the operation and
    rank 1 (its argument was ignored: it waited for ever); once rank 1 joins, work.wait() returns the sum."""
    job = aiaccrun(2, "torch_timeouts.py", "wait", timeout=120)
    assert_ok(job, 2, checks=lambda r: 3 - r)


def test_send_and_recv_a_peer_never_matches_raise_after_the_timeout():
    """recv from a rank that never sends, on a group made with timeout=3 s: RuntimeError naming recv, the peer, the
    group and the timeout, the tensor untouched, the group unusable after it; a 4 MiB send the peer does not receive
    (yet) raises the same way, and the peer receives it later; work.wait(timeout=2 s) on an irecv raises and the
    receive still completes; a send's or receive's future waited for ends by itself, with the tensor or the timeout's
    error (it hung). Before, send and recv ignored timeouts: rank 0 waited in MPI_Wait for ever."""
    job = aiaccrun(2, "torch_timeouts.py", "p2p", timeout=120)
    assert_ok(job, 2, checks=lambda r: 11 if r == 0 else 6)
    assert len(job.lines("ERROR-SEEN rank=0: ")) == 5, job.output


def test_dropped_isend_irecv_and_batch_works_deliver_keep_nothing_and_end_cleanly():
    """dist.isend(x * 2, 1) whose Work is dropped (200 of 256 KiB, with send and dropped batch_isend_irecv lists):
    the receiver gets exactly what was sent, as over gloo (before: MPI read the freed temporary, garbage); dropped
    irecvs into a contiguous and a strided tensor land (before: a segfault); work.is_completed() turns true without
    a wait (it never did); the operations in flight drop back to
    none; a dropped 4 MiB send its peer receives after the sender called destroy_process_group arrives."""
    job = aiaccrun(2, "torch_p2p_dropped.py", "dropped", timeout=180)
    assert_ok(job, 2, checks=lambda r: 3 if r == 0 else 9)


def test_dropped_point_to_point_nobody_matches_ends_at_the_groups_timeout_with_a_warning():
    """On a group with timeout=3 s: work.wait(timeout=1 s) on a send not yet received raises naming the send, the
    peer, the tag and the timeout, and the send still completes; a dropped send and irecv nobody matches make
    destroy_process_group wait at most the group's timeout, then warn naming both; the job ends."""
    job = aiaccrun(2, "torch_p2p_dropped.py", "unmatched", timeout=120)
    assert_ok(job, 2, checks=lambda r: 4 if r == 0 else 2)
    assert len(job.lines("ERROR-SEEN rank=0: ")) == 1, job.output
    assert "aiacc backend: rank 0 gave up, past the group's timeout, on 2 point-to-point operations the script did " \
           "not wait for (send to rank 1, tag 7, recv from rank 1, tag 8): receives cancelled, sends left to MPI" \
           in job.output, job.output


def test_point_to_point_wait_returns_with_the_tensor_filled_while_another_thread_polls_it():
    """Receives into strided tensors that another thread polls with is_completed() (ending them, copying the message
    in): once is_success() is true, wait() returns with the message in the tensor (before: 45 of 100 half filled)."""
    job = aiaccrun(2, "torch_p2p_dropped.py", "threads", timeout=180)
    assert_ok(job, 2, checks=lambda r: 2 if r == 0 else 3)


def test_destroy_process_group_in_finally_does_not_hold_a_failing_job_for_the_groups_timeout():
    """Rank 0 raises with an irecv nobody matches in flight, destroy_process_group in a finally:, rank 1 waits in an
    all_reduce: the job ends at once with rank 0's error and a warning naming the receive (it hung for the group's
    30-minute timeout)."""
    job = aiaccrun(2, "torch_p2p_dropped.py", "failing", timeout=90)
    assert job.returncode != 0, job.output
    assert "ValueError: a bug on rank 0" in job.output, job.output
    assert "aiacc backend: rank 0 gave up, as a ValueError ends the script, on 1 point-to-point operations the " \
           "script did not wait for (recv from rank 1, tag 9): receives cancelled, sends left to MPI" in job.output, \
        job.output


def test_exit_with_an_unmatched_irecv_in_flight_cancels_it_and_ends_the_job():
    """Rank 0 ends with sys.exit(1) with an irecv nobody matches in flight (no destroy_process_group), rank 1 waits in
    an all_reduce: at exit the receive, which nothing can read any more, is cancelled after 5 s with a warning naming
    it, and the job ends with rank 0's status (it waited for the group's 30-minute timeout)."""
    job = aiaccrun(2, "torch_p2p_dropped.py", "exiting", timeout=90)
    assert job.returncode != 0, job.output
    assert "aiacc backend: rank 0 gave up, at exit, on 1 point-to-point operations the script did not wait for " \
           "(recv from rank 1, tag 9): receives cancelled, sends left to MPI" in job.output, job.output


def test_new_group_raises_naming_a_member_that_never_calls_it():
    """new_group([0, 2], use_local_synchronization=True, timeout=3 s) at 3 ranks, member 2 not calling it: rank 0
    gets a RuntimeError naming rank 2 (it waited in MPI_Comm_create_group for ever); member 2 calling it after rank 0
    gave up gets an error saying so, no hang; the default group still works."""
    job = aiaccrun(3, "torch_timeouts.py", "new_group", timeout=120)
    assert_ok(job, 3, checks=lambda r: 1 if r == 1 else 2)


def test_closure_loss_is_averaged_and_unnamed_optimizers_get_names_of_their_own():
    """LBFGS with a strong-Wolfe line search decides on the closure's loss: the ranks used to decide on their own
    ones and split apart, then stall. Two optimizers wrapped without named_parameters used to share Horovod's
    default gradient names (a DuplicateNameError at their second step)."""
    assert_ok(aiaccrun(2, "torch_closure.py", timeout=180), 2, checks=6)


@pytest.mark.parametrize("ranks", [2, 3])
def test_a_partial_accumulation_window_refuses_a_change_before_averaging_and_takes_horovods_recipe(ranks):
    """backward_passes_per_step=2, epochs of 3 micro-batches: in the last, partial window a clip through
    opt.param_groups clipped each rank's own gradients and step() averaged them, silently; now refused on every
    rank, naming them. Horovod's recipe there, synchronize() then zero_grad() to drop the window, and GradScaler's
    unscale_ (which averages first: each rank unscaled its own, and an overflow on one rank had it skip alone) equal
    one process accumulating every rank's micro-batches."""
    assert_ok(aiaccrun(ranks, "torch_partial_window.py", timeout=180), ranks, checks=10)


@pytest.mark.parametrize("ranks", [2, 3])
def test_sync_batch_norm_equals_one_batch_norm_over_the_global_batch(ranks):
    """Outputs, input gradients and running statistics of hvd.SyncBatchNorm (1d/2d/3d, uneven and empty per-rank
    batches) equal one nn.BatchNorm over the global batch; a converted model trained with DistributedOptimizer
    equals the plain model trained on the whole batch in one process."""
    assert_ok(aiaccrun(ranks, "torch_sync_bn.py", timeout=180), ranks, checks=66)


@pytest.mark.parametrize("backend,checks", [("inductor", 2), ("aot_eager", 6)])
def test_torch_compile_models_train_equal_to_eager_one_process(backend, checks, tmp_path):
    """DistributedOptimizer on a torch.compile'd model (whole, or block by block) equals the eager model on the
    whole batch in one process; also with backward_passes_per_step=2 and under compiled autograd; overlap_forward
    is refused with an error.
    The whole-model case warns that its backward cannot overlap communication."""
    job = aiaccrun(2, "torch_compile.py", backend, timeout=600,
                   env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")})
    assert_ok(job, 2, checks=checks)


def test_ddp_example_on_the_aiacc_backend_with_sync_batch_norm_learns_digits():
    job = run([sys.executable, "-m", "aiacc.launcher", "-np", "2", sys.executable,
               str(ROOT / "examples" / "pytorch_ddp_digits.py"), "--sync-bn", "--epochs", "5"], timeout=180)
    assert job.returncode == 0, job.output
    accuracies = [float(a) for a in re.findall(r"test accuracy (\d\.\d+)", job.output)]
    assert len(accuracies) == 5 and accuracies[-1] >= 0.95, job.output


@pytest.mark.parametrize("ranks", [2, 3])
def test_c10d_benchmark_prints_aiacc_and_gloo_figures(ranks):
    """At 3 ranks, before the DDP models were let go ahead of the gloo group, about one run in five hung at
    exit in torch's destructor of the group (see bench/c10d.py, _ddp_rates)."""
    job = run([sys.executable, "-m", "aiacc.launcher", "-np", str(ranks), sys.executable, "-m", "aiacc.bench", "c10d",
               "--sizes", "4KiB", "--models", "cnn", "--batch-size", "4", "--steps", "2", "--repeats", "1", "--json"],
              timeout=120)
    assert job.returncode == 0, job.output
    rows = [json.loads(line) for line in job.output.splitlines() if line.startswith("{")]
    assert [r["part"] for r in rows] == ["allreduce", "ddp"], job.output
    assert rows[0]["aiacc_us"] > 0 and rows[0]["gloo_us"] > 0 and rows[1]["aiacc_sps"] > 0 and rows[1]["gloo_sps"] > 0


def test_bucket_cap_mb_sets_the_buckets_of_one_optimizer_and_is_checked():
    """DistributedOptimizer(bucket_cap_mb=) as DDP's: smaller buckets, more of them, the same result; a size
    that is not > 0 is refused naming the argument (also switched off, before init)."""
    need_framework("torch")
    script = """
import torch, aiacc.torch as hvd
hvd.init()
results = {}
for cap in (0.25, 25):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), bucket_cap_mb=cap,
                                   named_parameters=[(f"c{cap}.{k}", p) for k, p in model.named_parameters()])
    model(torch.ones(2, 256) * (hvd.rank() + 1)).sum().backward()
    opt.step()
    results[cap] = (len(opt._aiacc_buckets.buckets), [p.detach().clone() for p in model.parameters()])
assert all(torch.equal(a, b) for a, b in zip(results[0.25][1], results[25][1]))
print(f"BUCKETS rank={hvd.rank()} small={results[0.25][0]} default={results[25][0]}", flush=True)
for cap in (0, float("inf"), "5"):
    try:
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), bucket_cap_mb=cap)
    except ValueError as exc:
        print(f"REFUSED rank={hvd.rank()}: {exc}", flush=True)
"""
    job = run([sys.executable, "-m", "aiacc.launcher", "-np", "2", sys.executable, "-c", script], timeout=120)
    assert job.returncode == 0, job.output
    # 4 x (256 KiB weight + 1 KiB bias): one bucket per layer at 0.25 MiB, all in one at 25 MiB
    assert job.output.count("small=4 default=1") == 2, job.output
    for cap in ("0", "inf", "'5'"):  # inf was an OverflowError, a string a TypeError, neither naming the argument
        assert job.output.count(f"DistributedOptimizer: bucket_cap_mb={cap}; expected a size in MiB > 0") == 2, job.output


def test_in_place_allreduce_follows_the_tensor_under_a_name():
    assert_ok(aiaccrun(2, "torch_views.py"), 2, checks=11)


def test_adasum_optimizer_combines_each_ranks_local_step_as_horovods():
    job = aiaccrun(2, "torch_adasum.py", timeout=120)
    # 3 steps x (6 parameters + the ranks agree), 4 steps taking in parameters trainable since wrapping (unfrozen,
    # added with add_param_group: never trained before), 2 misuse errors, fp16, 1 bad argument
    assert_ok(job, 2, checks=29)


def test_adasum_optimizer_gradients_zeroed_or_changed_in_place_equal_a_replay_of_both_ranks():
    """DistributedOptimizer(op=Adasum) with gradients zeroed in place (zero_grad(set_to_none=False)): between
    backward and a new backward with model.zero_grad (a GAN's netD.zero_grad() in older scripts) it raised 'computed
    more than backward_passes_per_step' on the next backward; zeroed or clipped (clip_grad_norm_) before step(), the
    step applied the changes from the gradients of backward, silently. Now each equals a replay of both ranks with
    Adasum's formula, as with set_to_none=True (also opt.zero_grad in the loop and between backward and step(),
    backward_passes_per_step=2, Adam; and the Average optimizer with set_to_none=False against one process)
    (tests/workers/torch_adasum_zero.py). Changes without a new version (p.grad.data.clamp_, a GradScaler's
    unscale_) were applied as backward left them, silently; clip_grad_norm_ under SGD(nesterov, foreach) stepped
    again on the gradient its local step had changed; and gradients that are views of one tensor (torch.cat of
    parameters) share a version counter, so a plain loop sent every step twice (wrong too under nesterov): now
    equal to the replay, and a plain loop begins no step again (opt._aiacc_discards == 0)."""
    assert_ok(aiaccrun(2, "torch_adasum_zero.py", timeout=120), 2, checks=29)


def test_parameters_not_row_major_under_fused_and_compiled_optimizer_steps():
    """A channels_last convolution and a transposed weight under torch's fused Adam / SGD: their gradients were
    row-major bucket views, which the fused kernels misread (0.06 off after 3 steps, the ranks agreeing); now laid
    out as the parameters. torch.compile(opt.step) and a compiled step calling opt.step() stopped in dynamo
    (SpeculationLogDivergence); the wrapper's step now runs as it is. Each equals one process."""
    assert_ok(aiaccrun(2, "torch_layouts.py", timeout=240), 2, checks=16)


def test_parameters_converted_replaced_repeated_or_wrapped_twice_average_or_are_refused_by_name():
    """model.to(memory_format=channels_last) after the first step left each rank's own gradient in p.grad (the
    bucket views got memory of their own: torch's Module._apply sets .data), silently; before it, fused Adam
    misread row-major gradients. model.double() crashed in torch or went unaveraged; a parameter put in place of
    another, unnoticed; one listed twice, an error about an internal name; a wrapper made while an older one of the
    same parameters lived, an error about a replaced gradient or about backward_passes_per_step. Now equal to one
    process (the newest wrapper takes the parameters over), or refused naming the parameter."""
    assert_ok(aiaccrun(2, "torch_structure.py", timeout=240), 2, checks=18)


def test_clipping_after_the_average_equals_one_process_and_ddps_loop_is_refused_not_timed():
    """clip_grad_norm_ / clip_grad_value_ over model.parameters() between backward() and step() used to change
    gradients while their buckets were averaged: clipped before or after the engine read them by timing, silently
    other numbers than one process's. Horovod's recipe and clipping through opt.param_groups equal one process
    averaging then clipping; DDP's loop is a RuntimeError at the second step naming the gradients and the recipe,
    also where the bucket waits for step() (a parameter no rank uses), which averaged each rank's clipped gradients
    without a word (tests/workers/torch_clip.py)."""
    assert_ok(aiaccrun(2, "torch_clip.py", timeout=180), 2, checks=7)


@pytest.mark.parametrize("ranks", [2, 3])
def test_training_patterns_equal_one_process_frozen_unused_gan_checkpoint_tied(ranks):
    """A layer frozen mid-training and unfrozen later, param groups added mid-training with add_param_group (a
    frozen layer unfrozen, a new parameter; SGD, Adam, overlap_forward: refused at step() before), a branch no rank
    takes in some steps (SGD with momentum and weight decay, Adam; zero_grad with and without set_to_none); a GAN's
    two optimizers stepped alternately, the
    discriminator's gradients from the generator's backward thrown away (netD.zero_grad(), optD.zero_grad()) or
    frozen, only some of them thrown away, and zeroed in place refused; activation checkpointing over tied weights and a layer applied twice, with
    gradients changed between synchronize() and step() (tests/workers/torch_patterns.py)."""
    assert_ok(aiaccrun(ranks, "torch_patterns.py", timeout=180), ranks, checks=23)


def test_sparse_gradient_unused_everywhere_and_adasum_gan_equal_one_process():
    """An nn.Embedding/EmbeddingBag(sparse=True) that no rank used in a step got an empty sparse gradient, which
    SGD's momentum, Adagrad and SparseAdam stepped (one process skips a None one): now None, equal to one process
    (also used by one rank only, and with sparse_as_dense). One that no rank used in the first step went in a dense
    bucket and its later gradients came dense, which SparseAdam refused ('SparseAdam does not support dense
    gradients'): now it leaves the bucket once a rank has a sparse one (also with overlap_forward), equal to one
    process. DistributedOptimizer(op=Adasum) refused a GAN's loop
    that throws the discriminator's gradients away between backward and step (optD.zero_grad()), or failed on the
    next backward (netD.zero_grad()) after a forward that read the deltas in the parameters, and applied the
    deltas of gradients set to None or by hand before step(); now equal to a replay of both ranks with Adasum's
    formula (tests/workers/torch_odds.py)."""
    assert_ok(aiaccrun(2, "torch_odds.py", timeout=180), 2, checks=57)


@pytest.mark.parametrize("ranks", [2, 3])
def test_parameters_unfrozen_frozen_or_regrouped_between_steps_equal_one_process_or_name_the_ranks(ranks):
    """The fine-tuning recipe (an optimizer over every parameter, the backbone frozen before wrapping or before the
    first step, unfrozen on every rank, frozen again; SGD with momentum, Adam, backward_passes_per_step=2,
    overlap_forward) and ``opt.param_groups = [...]`` between steps: refused at step() before (unfreezing), or the
    new parameters left out (param_groups); now the buckets are laid out again and training equals one process. One
    rank alone unfreezing, freezing or adding a group (also before the first step) waited for the stall inspector;
    now every rank raises at once, naming the ranks and the parameters. ``param_groups`` assigned between backward()
    and step(): refused naming the gradients in flight (tests/workers/torch_unfreeze.py)."""
    job = aiaccrun(ranks, "torch_unfreeze.py", timeout=180)
    assert_ok(job, ranks, checks=17)
    others = "rank 1" if ranks == 2 else "ranks " + ",".join(str(k) for k in range(1, ranks))
    for what in ("unfreezes", "freezes", "adds a group", "adds a group before the first step",
                 "adds a group after the first step", "assigned late"):
        for r in range(ranks):
            assert job.lines(f"ERROR-SEEN rank={r}: {what}: "), job.output
    assert f"rank 0 changed the gradients it averages between steps and {others} did not" in job.output, job.output


@pytest.mark.parametrize("ranks", [2, 3])
def test_trainable_sets_alternating_reuse_their_bucket_layouts_and_equal_one_process(ranks):
    """requires_grad toggled every step or two (a GAN's two sub-networks under one optimizer, a fine-tuning schedule,
    three sets in turn; SGD with momentum and weight decay, Adam; set_to_none True and False): every change laid the
    buckets out anew (8 layouts in 8 steps of a GAN-style alternation); now one per trainable set, a set seen before
    takes its kept layout up. Parameters, gradients as torch leaves them and optimizer state equal one process; a rank
    going back to a set alone is an error on every rank naming the ranks (tests/workers/torch_alternate.py). Guards of
    what a kept layout brings back: a sparse embedding (set_to_none=False), overlap_forward, backward_passes_per_step=2
    toggled between the passes."""
    job = aiaccrun(ranks, "torch_alternate.py", timeout=180)
    assert_ok(job, ranks, checks=24)
    others = "rank 1" if ranks == 2 else "ranks " + ",".join(str(k) for k in range(1, ranks))
    for r in range(ranks):
        assert job.lines(f"ERROR-SEEN rank={r}: rank 0 changed the gradients it averages between steps and {others} "
                         "did not"), job.output


@pytest.mark.parametrize("ranks", [2, 3])
def test_complex_parameters_train_and_complex_tensors_reduce_equal_to_one_process(ranks):
    """A model with complex parameters (nn.Linear(...).to(torch.complex64)) under DistributedOptimizer failed:
    "tensor 'Parameter.0.bias' has dtype complex64, which aiacc does not support". Now SGD with momentum and Adam
    (also backward_passes_per_step=2) over complex and real parameters equal one process on the whole batch;
    allreduce (conjugate views too), allgather, broadcast, reducescatter of complex tensors equal their
    references; broadcast_parameters / broadcast_optimizer_state carry complex state; DDP on the aiacc backend
    equals DDP on gloo; Min / Max / Product are refused naming the tensor, dtype and op
    (tests/workers/torch_complex.py)."""
    job = aiaccrun(ranks, "torch_complex.py", timeout=180)
    assert_ok(job, ranks, checks=49 + 2 * ranks)
    assert "op=Max is not defined for complex tensors (complex128)" in job.output, job.output


def test_overlap_forward_with_parameters_read_or_changed_between_step_and_the_next_forward():
    """Weight clipping (WGAN), a hand-made weight decay and an EMA after opt.synchronize(); torch.save of the
    state_dict, an eval forward and load_state_dict into another model; GradScaler with a skipped step: equal to one
    process. A parameter changed in place without synchronize() is refused naming it (it was silently changed
    before its update instead of after)."""
    job = aiaccrun(2, "torch_overlap_changes.py", timeout=180)
    assert_ok(job, 2, checks=6)
    assert "ERROR-SEEN rank=1: parameter 'unsynced.0.weight' was changed in place after step()" in job.output


def test_broadcast_parameters_of_models_that_differ_across_ranks_names_the_tensors_on_every_rank():
    """A layer more on one rank (state_dict, named_parameters, plain parameters()): each rank waited for broadcasts
    the other never sent, a hang until the stall shutdown; now one error on every rank naming the tensors only
    some ranks have and the ranks, nothing changed, and the job goes on (tests/workers/torch_mistakes.py). A rank
    that runs a step fewer (uneven shards, no join()): the other's ShutdownError names it and advises join()."""
    job = aiaccrun(2, "torch_mistakes.py", timeout=90)
    assert_ok(job, 2)
    for r in range(2):
        for case in ("state_dict", "named_parameters", "parameters", "module"):
            assert job.lines(f"ERROR-SEEN rank={r} {case}: "), job.output
    assert job.lines("ERROR-SEEN rank=0 uneven: "), job.output  # a rank a step short: named, join() advised


def test_slips_that_trained_on_silently_are_errors_naming_the_fix():
    """Stepping the optimizer DistributedOptimizer wrapped (kept under another name, or the wrapper not kept), step()
    inside skip_synchronize() without synchronize() (and no warning for synchronize() after step()),
    broadcast_optimizer_state across optimizer classes, SyncBatchNorm of other widths, a nested tensor: an error on
    every rank saying what to do, nothing changed, and training then equal to one process
    (tests/workers/torch_slips.py)."""
    job = aiaccrun(2, "torch_slips.py", timeout=120)
    assert_ok(job, 2, checks=13)
    for r in range(2):
        for case in ("kept", "not kept", "skip", "classes", "syncbn", "syncbn dtype", "nested"):
            assert job.lines(f"ERROR-SEEN rank={r} {case}: "), job.output
