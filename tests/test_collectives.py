"""Every collective on real multi-process jobs, checked against numpy references."""

import pytest

from conftest import ROOT, aiaccrun, assert_ok, assert_trains_as_one_process, run

import sys


@pytest.mark.parametrize("np_", [2, 3])
def test_every_collective_and_dtype_matches_numpy(np_):
    job = aiaccrun(np_, "collectives.py")
    # a broadcast from every root for each of the 9 dtypes; 5 integer dtypes x 1, 4 float ones x 2 (NaN Max/Min);
    # complex64 and complex128: 47 checks each and a broadcast from every root
    assert_ok(job, np_, checks=157 + 9 * np_ + 5 + 8 + 4 + 12 + 3 + 2 * (47 + np_) + 2)  # (+2: a fused small result)


@pytest.mark.parametrize("np_", [2, 3])
def test_ranks_may_submit_in_different_orders_and_cache_skips_the_gather(np_):
    job = aiaccrun(np_, "orders.py")
    assert_ok(job, np_)


def test_ranks_that_judge_the_link_differently_do_not_hang():
    job = aiaccrun(2, "mixed_waits.py", timeout=60)
    assert_ok(job, 2)


def test_plain_mpiexec_started_by_hand_works():
    from aiacc.launcher import find_mpiexec

    mpiexec, _ = find_mpiexec()
    from conftest import WORKERS

    job = run([mpiexec, "-n", "2", sys.executable, str(WORKERS / "orders.py")], env={"AIACC_ENABLE": "1"})
    assert_ok(job, 2)


def test_timeline_records_every_phase_of_every_tensor(tmp_path):
    import json

    path = tmp_path / "run.json"
    job = aiaccrun(2, "orders.py", flags=["--timeline", str(path)])
    assert_ok(job, 2)
    events = json.loads(path.read_text())  # valid JSON, as Perfetto needs
    spans = [e for e in events if e.get("ph") == "X"]
    tracks = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "thread_name"}
    by_tensor = {}
    for e in spans:
        by_tensor.setdefault(tracks[e["tid"]], set()).add(e["name"])
    for i in range(40):
        # a track per tensor, named as Horovod's PyTorch core names the op (allreduce.<name>)
        assert by_tensor[f"allreduce.grad.{i}"] == {"QUEUE", "NEGOTIATE_ALLREDUCE", "MEMCPY_IN_FUSION_BUFFER",
                                                    "ALLREDUCE", "MEMCPY_OUT_FUSION_BUFFER"}, sorted(by_tensor)
    assert "cycle" in by_tensor["cycles"]
    assert any(name.startswith("allreduce x") for name in by_tensor["buffers"])
    assert not (tmp_path / "run.json.rank1").exists()  # rank 0 only by default
    assert all(e["pid"] == 0 for e in events)


def test_timeline_tracks_with_credit_and_process_sets_added_after_start_or_stop(tmp_path):
    """Buffers in flight together used to share one track and overlap partly there (Perfetto drops such
    events); a process set's file was labelled with the rank in the set; sets added after start_timeline wrote
    no file, and after stop_timeline one still."""
    job = aiaccrun(3, "timeline_sets.py", str(tmp_path / "t.json"), timeout=180,
                   flags=["--timeline", str(tmp_path / "t.json"), "--timeline-all-ranks", "--partition-bytes", "256KiB",
                          "--credit-bytes", "512KiB"])
    assert_ok(job, 3, checks=lambda k: 3 if k == 0 else 0)


def test_timeline_of_a_job_aborted_by_an_exception_is_valid_json(tmp_path):
    """The file is a complete JSON array after every cycle's flush (Horovod's writer's rule): a job that an
    uncaught exception aborted left one without its closing bracket."""
    import json

    path = tmp_path / "exc.json"
    job = aiaccrun(2, "errors.py", "uncaught", timeout=60, flags=["--timeline", str(path)])
    assert job.returncode != 0 and "boom on rank 1" in job.output, job.output
    events = json.loads(path.read_text())
    assert any(e.get("name") == "process_name" for e in events), events


def test_timeline_file_on_disk_is_a_complete_array_between_flushes_even_past_64_kib(tmp_path):
    """A cycle's events past the file's 64 KiB buffer reached the disk before the cycle's flush wrote the closing
    bracket: a job killed then, or a reader at that moment, found an array without its end. The file is also a
    complete (empty) array before the first cycle. (The file itself, as the engine's writer uses it.)"""
    import json

    from aiacc.timeline import Timeline

    path = tmp_path / "t.json"
    tl = Timeline(str(path), 0)
    assert [e["name"] for e in json.loads(path.read_text())] == [
        "process_name", "thread_name", "thread_sort_index", "thread_name", "thread_sort_index"]
    for i in range(3000):  # one cycle of ~300 KiB of events, not flushed yet
        tl.span(f"allreduce.t{i}", "ALLREDUCE", tl._t0 + i * 1e-6, tl._t0 + (i + 1) * 1e-6)
    before = json.loads(path.read_text())  # (raised 'Expecting , delimiter')
    assert not any(e.get("ph") == "X" for e in before), len(before)
    tl.flush()
    spans = [e for e in json.loads(path.read_text()) if e.get("ph") == "X"]
    assert len(spans) == 3000 and all(e["ts"] >= 0 for e in spans)
    tl.span("cycles", "cycle", tl._t0 - 5.0, tl._t0 + 1.0)  # began before the timeline: from its start
    tl.close()
    events = json.loads(path.read_text())
    late = [e for e in events if e.get("ph") == "X" and e["name"] == "cycle"]
    assert late[0]["ts"] == 0 and late[0]["dur"] == 1e6 and events[-1]["name"] == "aiacc_end", late


@pytest.mark.parametrize("ranks", [2, 3])
def test_join_contributes_the_identity_of_every_op_and_refuses_other_collectives(ranks):
    job = aiaccrun(ranks, "join.py", timeout=120)
    # a contributing rank runs 2 x 24 allreduces, 3 more (grouped, fp16) and 3 refused collectives
    # per round, and every rank checks join()'s result in every round; then rank 0's thread is refused twice while
    # rank 0 has joined (the others check their allreduce without it), and every rank one allreduce after
    assert_ok(job, ranks, checks=lambda k: (ranks - 1) * (2 * 24 + 6) + ranks + (3 if k == 0 else 2))


@pytest.mark.parametrize("ranks", [2, 3])
def test_process_sets_run_every_collective_among_their_ranks(ranks):
    job = aiaccrun(ranks, "process_sets.py", str(ranks), timeout=120)
    # 3 steps of 8 checks, 5 errors, which sets a rank is outside of, a list given to remove_process_set, the global
    # set after shutdown; the even ranks' check after remove; with 3 ranks, ranks 0 and 1 also use the set registered
    # by init(), and the even ranks' set of two sees a mismatch
    big = ranks > 2  # (the even ranks' set has 2 members: mismatch checks; job rank 2 sees the set removed)
    assert_ok(job, ranks, checks=lambda k: 24 + 6 + 3 + (k % 2 == 0) + (big and k < 2) + 3 * (big and k % 2 == 0)
              + (big and k == 2))


def test_a_process_set_object_of_a_set_no_longer_registered_is_refused_not_run_on_the_next_set():
    # after shutdown() + init(), or remove_process_set through another object of the set, the next set added gets
    # the freed id; the old objects used to keep it and run on that set (ranks 1 and 2 summed for a set of 0 and 1)
    job = aiaccrun(3, "process_sets_stale.py", timeout=120)
    assert_ok(job, 3, checks=lambda k: 2 + (k in (1, 2)) + (k in (0, 2)))


def test_an_operation_pending_on_a_removed_set_says_so_whichever_member_stops_first():
    # a member that stops its engine late used to be told "shut down by rank 0 (shutdown() or the end of the script)"
    job = aiaccrun(3, "process_sets_removed.py", timeout=120)
    assert_ok(job, 3, checks=lambda k: 2 if k == 2 else 1)


def test_init_registers_process_sets_of_communicators_with_horovods_rules():
    # MPI left unstarted by the script (mpi4py.rc.initialize = False): aiacc starts and finalizes it
    job = aiaccrun(3, "process_sets_init.py", timeout=120)
    assert_ok(job, 3, checks=lambda k: 8 + (k < 2))  # one reduction per set a rank is in: 3 / 3 / 2


@pytest.mark.parametrize("variable,value,mode,checks", [
    ("HOROVOD_DYNAMIC_PROCESS_SETS", "0", "off", 3), ("AIACC_DYNAMIC_PROCESS_SETS", "0", "off", 3),
    ("HOROVOD_DYNAMIC_PROCESS_SETS", "1", "on", 2), ("AIACC_DYNAMIC_PROCESS_SETS", "1", "on", 2),
    ("HOROVOD_DYNAMIC_PROCESS_SETS", "0", "init-dynamic", 1)])
def test_dynamic_process_sets_setting_allows_or_refuses_adding_sets_after_init(variable, value, mode, checks):
    # Horovod's HOROVOD_DYNAMIC_PROCESS_SETS was ignored (adding always worked) and AIACC_DYNAMIC_PROCESS_SETS was
    # refused as an unknown variable; off now gives Horovod's static sets, a ValueError naming the variable
    job = aiaccrun(2, "process_sets_static.py", mode, env={variable: value}, timeout=120)
    assert_ok(job, 2, checks=checks)


def test_timeline_under_horovods_variables_can_be_read_while_the_job_runs(tmp_path):
    path = tmp_path / "hvd.json"
    job = aiaccrun(2, "timeline_live.py", env={"HOROVOD_TIMELINE": str(path), "HOROVOD_TIMELINE_MARK_CYCLES": "1"})
    assert_ok(job, 2, checks=lambda k: 5 if k == 0 else 1)


def test_adasum_equals_the_papers_tree_on_four_ranks():
    job = aiaccrun(4, "adasum.py", timeout=120)
    assert_ok(job, 4, checks=lambda k: 10 if k == 1 else 9)  # rank 1 is in both process sets


def test_init_with_a_list_of_ranks_runs_on_those_and_names_a_rank_left_out():
    job = aiaccrun(3, "init_comm.py", timeout=120)
    assert job.returncode == 0, job.output
    assert "OK rank=0 world=2" in job.output and "OK rank=1 world=0" in job.output, job.output
    assert "LEFT-OUT world=1" in job.output, job.output


def test_collectives_from_several_threads_of_each_rank_all_finish():
    job = aiaccrun(2, "threads.py", timeout=120)
    assert_ok(job, 2)
    assert job.output.count("threads=3 steps=150") == 2, job.output


def test_numpy_example_trains_as_one_process_on_3_ranks():
    """``--batch-size`` is the global batch: on 3 ranks each took 64 // 3 = 21 samples, so every step trained on
    63 (epoch 1: loss 1.6594, test accuracy 0.780, against one process's 1.6586 and 0.731). Now the batch is
    split 22/21/21 and the gradients weighted by it: every epoch's loss and accuracy are one process's."""
    example = str(ROOT / "examples" / "numpy_digits.py")
    one = run([sys.executable, example, "--epochs", "5"], timeout=120)
    many = aiaccrun(3, example, "--epochs", "5", timeout=180)
    assert_trains_as_one_process(one, many, 5)
    tiny = aiaccrun(3, example, "--batch-size", "2", timeout=120)
    assert tiny.returncode != 0
    assert "--batch-size 2 is the global batch and smaller than the number of ranks (3)" in tiny.output, tiny.output



def test_a_process_set_added_on_some_ranks_only_is_a_stall_error_not_a_hang():
    # the ranks that called add_process_set waited in its allgather for ever, past the stall shutdown (which watches
    # the engines only); now a StallError at the stall shutdown saying the call is collective, the job goes on
    # naming the rank that did not call (rank 1 of 3)
    job = aiaccrun(3, "process_sets_partial.py", env={"AIACC_STALL_SHUTDOWN_SECONDS": "3"}, timeout=120)
    assert_ok(job, 3, checks=lambda k: 1 if k == 1 else 4)
