"""Horovod's elastic state objects in the core (aiacc.elastic), in one process: what commit, restore and sync
keep, and that ``run`` starts from the synchronised state; the commit directory of restart-based recovery
(whole files only, damaged ones skipped, another job's refused); and real 2-rank jobs under
``aiaccrun --max-restarts`` with a rank killed or raising. (A 2-rank sync of TensorFlow variables and a Keras
model: tests/workers/tf_horovod.py.)"""

import os
import pickle
import random
import re
import shutil
import subprocess
import sys
import threading

import pytest

from aiacc.elastic import CommitStore, ElasticStateError, ObjectState, run
from conftest import TENSORFLOW, WORKERS, aiaccrun, assert_ok, base_env, need_framework, python
from conftest import run as run_job


class RankZeroSends:
    """A stand-in for broadcast_object on a rank other than 0: it receives rank 0's object."""

    def __init__(self, root_object):
        self.root_object = root_object
        self.calls = 0

    def __call__(self, obj):
        self.calls += 1
        assert set(obj) == set(self.root_object), obj  # every rank sends the same attributes
        return dict(self.root_object)


def test_object_state_commit_restore_and_sync():
    bcast = RankZeroSends({"epoch": 3, "batch": 7})
    state = ObjectState(bcast_object=bcast, get_rank=lambda: 1, epoch=5, batch=0)
    assert (state.epoch, state.batch) == (5, 0)
    state.sync()
    assert (state.epoch, state.batch, bcast.calls) == (3, 7, 1)
    state.epoch, state.batch = 4, 1
    state.restore()  # back to the last synchronised (or committed) values
    assert (state.epoch, state.batch) == (3, 7)
    state.epoch = 9
    state.commit()
    state.epoch = 10
    state.restore()
    assert state.epoch == 9


def test_object_state_restore_returns_to_the_commit_after_changes_in_place():
    """``save`` copies the attributes: a list or dict changed in place after a commit (a history appended to) is
    back as committed after ``restore()``, as often as asked, as the commit written to the directory (pickled at
    the commit) has it. It kept references: restore() left the changes in place, also on rank 0 after sync()."""
    losses, seen = [1.0], {"a": 1}
    state = ObjectState(bcast_object=lambda obj: obj, get_rank=lambda: 0, losses=losses, seen=seen)
    state.losses.append(2.0)
    state.restore()  # back to the values it was made with
    assert state.losses == [1.0] and losses == [1.0, 2.0]  # (the attribute was the list given, as in Horovod)
    state.sync()  # rank 0: broadcast_object hands back the object it was given
    state.losses.append(3.0)
    state.seen["b"] = 2
    state.restore()
    assert state.losses == [1.0] and state.seen == {"a": 1}
    state.losses.append(4.0)
    state.commit()
    for _ in range(2):  # changes made after a restore() never reach the commit
        state.losses.append(5.0)
        state.seen.clear()
        state.restore()
        assert state.losses == [1.0, 4.0] and state.seen == {"a": 1}


def test_run_syncs_first_and_calls_once():
    bcast = RankZeroSends({"epoch": 2})
    state = ObjectState(bcast_object=bcast, get_rank=lambda: 1, epoch=0)
    seen = []

    @run
    def train(s, extra):
        seen.append((s.epoch, extra))
        return "done"

    assert train(state, extra=1) == "done"
    assert seen == [(2, 1)] and bcast.calls == 1


def test_reset_callbacks_are_kept_and_called_on_reset():
    state = ObjectState(bcast_object=dict, get_rank=lambda: 0, epoch=0)
    called = []
    state.register_reset_callbacks([lambda: called.append(1)])
    state.on_reset()
    state.check_host_updates()  # a job that keeps its ranks: nothing to report, nothing raised
    assert called == [1]


# ---- restart-based recovery: the commit directory ---------------------------------------------------------

JOB = {"world_size": 2, "state": "TorchState", "layout": "step"}


def _payload(value):
    return lambda: {"objects": pickle.dumps({"step": value})}


def _step(payload) -> dict:
    return pickle.loads(payload["objects"])


def test_commits_are_written_whole_and_the_newest_intact_one_is_loaded(tmp_path, caplog):
    store = CommitStore(str(tmp_path))
    for step in (1, 2, 3, 4):
        store.write(_payload(step), JOB)
    store.flush()
    files = sorted(os.listdir(tmp_path))
    assert files == ["commit-00000002.aiacc", "commit-00000003.aiacc", "commit-00000004.aiacc"], files
    (tmp_path / "commit-00000005.aiacc.tmp").write_bytes(b"half a commit")  # died while writing: never loaded
    loaded = _step(CommitStore(str(tmp_path)).load_latest(JOB))
    assert loaded == {"step": 4}
    newest = tmp_path / "commit-00000004.aiacc"
    data = newest.read_bytes()
    newest.write_bytes(data[:-3] + b"xyz")  # damaged on disk: its checksum no longer matches
    loaded = _step(CommitStore(str(tmp_path)).load_latest(JOB))
    assert loaded == {"step": 3}
    assert "skipping damaged commit" in caplog.text and "commit-00000004" in caplog.text


def test_direct_io_commits_hold_the_same_bytes_as_buffered_ones(tmp_path):
    """Commit files written with O_DIRECT (where the filesystem takes it: this machine's disk) hold exactly the
    bytes of files written through the page cache (``direct_io=False``, ``AIACC_COMMIT_DIRECT_IO=0``, and the
    store's way where a filesystem refuses O_DIRECT), across the staging buffer's chunk boundary and with a last
    partial block."""
    import numpy as np

    from aiacc import elastic

    arrays = {"a": np.arange(9 * 2 ** 20 // 4 + 5, dtype=np.float32), "b": np.arange(1001, dtype=np.int64),
              "c": np.ones(3, np.uint8)}  # 9 MiB + odd sizes: a chunk flushed mid-array, an unaligned tail
    arrays.update({f"small{i}": np.full(i % 7 + 1, i, np.float32) for i in range(2000)})  # a header of ~7 KB
    contents = {}
    for direct in (True, False):
        d = tmp_path / f"direct{int(direct)}"
        store = CommitStore(str(d), direct_io=direct)
        store.write(lambda: {"objects": pickle.dumps({"step": 5}), "model": arrays}, JOB)
        store.flush()
        contents[direct] = (d / "commit-00000001.aiacc").read_bytes()
        loaded = store.load_latest(JOB)
        assert _step(loaded) == {"step": 5} and all(np.array_equal(loaded["model"][k], v) for k, v in arrays.items())
    assert contents[True] == contents[False]
    assert contents[True].index(b'"crc32"') > 4096  # the checksum lies beyond the first block
    probe = str(tmp_path / "probe")
    sink = elastic._open_sink(probe, True, 0)
    sink.close()
    assert isinstance(sink, elastic._DirectSink), "this machine's disk takes O_DIRECT"


def test_arrays_are_written_raw_and_load_back_writable(tmp_path):
    """A payload's numpy arrays go to the file as their own bytes (pickle's out-of-band buffers, not a copy
    inside the pickle) and come back equal and writable; a file of the first format still loads."""
    import hashlib
    import json

    import numpy as np

    big = np.arange(1 << 18, dtype=np.float32).reshape(512, 512)
    fortran = np.asfortranarray(np.arange(12.0).reshape(3, 4))
    store = CommitStore(str(tmp_path))
    store.write(lambda: {"objects": pickle.dumps({"step": 1}), "model": {"w": big, "f": fortran}}, JOB)
    store.flush()
    data = (tmp_path / "commit-00000001.aiacc").read_bytes()
    header = json.loads(data.split(b"\n")[1])
    assert header["buffers"] == [big.nbytes, fortran.nbytes] and header["pickle"] < 1000, header
    assert big.tobytes() in data
    loaded = store.load_latest(JOB)
    assert np.array_equal(loaded["model"]["w"], big) and np.array_equal(loaded["model"]["f"], fortran)
    loaded["model"]["w"][0, 0] = -1.0  # writable: a framework may adopt it as its own tensor
    assert all(a.ctypes.data % 64 == 0 for a in loaded["model"].values())  # aligned as TensorFlow needs
    # the first format (one pickle, sha256) of an earlier aiacc
    payload = pickle.dumps({"objects": pickle.dumps({"step": 7})})
    head = json.dumps({"seq": 2, "length": len(payload), "sha256": hashlib.sha256(payload).hexdigest(),
                       "fingerprint": JOB}).encode()
    (tmp_path / "commit-00000002.aiacc").write_bytes(b"AIACC-COMMIT-1\n" + head + b"\n" + payload)
    assert _step(store.load_latest(JOB)) == {"step": 7}


def test_a_half_written_commit_of_a_previous_job_is_removed_and_this_jobs_own_is_finished(tmp_path):
    (tmp_path / "commit-00000007.aiacc.tmp").write_bytes(b"AIACC-COMMIT-1\n{half")  # the last job ended here
    store = CommitStore(str(tmp_path))
    store.write(_payload(1), JOB)  # this job's commit, perhaps still being written
    assert store.discard_partial() == ["commit-00000007.aiacc.tmp"]
    assert sorted(os.listdir(tmp_path)) == ["commit-00000001.aiacc"]


def test_a_directory_of_another_job_is_refused(tmp_path):
    store = CommitStore(str(tmp_path))
    store.write(_payload(1), JOB)
    store.flush()
    with pytest.raises(ElasticStateError, match="holds commits of another job.*world_size=2.*world_size=4"):
        store.load_latest(dict(JOB, world_size=4))
    assert CommitStore(str(tmp_path / "empty")).load_latest(JOB) is None


def test_an_elastic_launch_accepts_commits_of_world_sizes_in_its_range_only(tmp_path):
    store = CommitStore(str(tmp_path))
    store.write(_payload(1), JOB)  # written by 2 ranks
    store.flush()
    three = dict(JOB, world_size=3)
    assert _step(store.load_latest(three, (2, 3))) == {"step": 1}
    with pytest.raises(ElasticStateError, match="world_size=2.*world_size=3.*allow: 3 to 4"):
        store.load_latest(three, (3, 4))
    with pytest.raises(ElasticStateError, match="another job"):
        store.load_latest(dict(three, layout="step,epoch"), (2, 3))  # another model: refused at any size
    with pytest.raises(ElasticStateError, match="another job"):
        store.load_latest(three)  # not an elastic launch: the world size must match


def test_an_attribute_that_cannot_be_saved_is_named_at_commit(tmp_path, monkeypatch):
    monkeypatch.setenv("AIACC_ELASTIC_DIR", str(tmp_path))
    state = ObjectState(bcast_object=lambda obj: obj, get_rank=lambda: 0, epoch=1, handle=threading.Lock())
    with pytest.raises(ElasticStateError, match="attribute 'handle' cannot be saved"):
        state.commit()
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".aiacc")]


def test_an_attribute_that_cannot_be_sent_is_named_at_sync():
    """sync() broadcasts the attributes (pickled): an unpicklable one is named, not pickle's bare error."""
    sent = []
    state = ObjectState(bcast_object=sent.append, get_rank=lambda: 0, epoch=1, handle=threading.Lock())
    with pytest.raises(ElasticStateError, match="attribute 'handle' cannot be saved"):
        state.sync()
    assert not sent


def test_closures_and_lambdas_are_synced_and_committed_as_broadcast_object_sends_them():
    """Horovod's sync() sends the attributes with broadcast_object (cloudpickle): a learning-rate schedule made
    by a closure travels; aiacc's check before sending used plain pickle and refused it."""
    def make_schedule(base):
        def schedule(epoch):
            return base * 0.5 ** epoch
        return schedule

    sent = []
    state = ObjectState(bcast_object=lambda obj: sent.append(obj) or obj, get_rank=lambda: 0, epoch=1,
                        schedule=make_schedule(0.1), scale=lambda x: 2 * x)
    state.sync()
    assert len(sent) == 1 and state.schedule(1) == 0.05
    state.epoch = 2
    state.commit()
    loaded = pickle.loads(state._objects_bytes())  # what a commit file holds for the attributes
    assert loaded["epoch"] == 2 and loaded["schedule"](2) == 0.025 and loaded["scale"](3) == 6


def test_each_elastic_phase_keeps_and_loads_its_own_commits(tmp_path):
    """Commits of a script's second ``run`` (phase 1) are kept apart from the first's: each phase loads its own
    newest commit, and each keeps its own last KEEP (the first phase's were loaded by the second: training
    skipped; or refused as another job's when the states differ)."""
    store = CommitStore(str(tmp_path), direct_io=False)
    first, second = {"world_size": 1, "layout": "a"}, {"world_size": 1, "layout": "a,b"}
    for step in range(5):
        store.write(_payload(step), first)
    store.write(_payload(100), second, phase=1)
    store.flush()
    assert _step(store.load_latest(first)) == {"step": 4}
    assert _step(store.load_latest(second, phase=1)) == {"step": 100}
    assert store.load_latest(first, phase=2) is None
    names = sorted(os.listdir(tmp_path))
    assert names == ["commit-00000003.aiacc", "commit-00000004.aiacc", "commit-00000005.aiacc",
                     "commit-00000006.p1.aiacc"], names
    assert _step(CommitStore(str(tmp_path)).load_latest(first)) == {"step": 4}  # a new start reads both phases


def _restarted_after_the_kill_of(rank: int, output: str, restart: str) -> bool:
    """aiaccrun's restart message names ``rank`` as killed by signal 9 (among the failed ranks it lists:
    MPI's cleanup may have recorded another rank as killed too)."""
    m = re.search(r"the job failed \(([^)]*)\); starting it again: " + re.escape(restart), output)
    return bool(m) and f"rank {rank} was killed by signal 9" in m.group(1).split(", ")


def _leftovers(worker: str) -> list:
    out = subprocess.run(["pgrep", "-f", worker], capture_output=True, text=True).stdout.split()
    return [pid for pid in out if int(pid) != os.getpid()]


@pytest.mark.parametrize("seed", [1, 2])
def test_a_rank_killed_at_a_random_step_resumes_from_the_last_commit(tmp_path, seed):
    """SIGKILL of one rank at a random step: the launcher ends the job, starts it again, every rank resumes
    from the last commit, and the final parameters equal an uninterrupted one-process run; no process is left."""
    need_framework("torch")
    rng = random.Random(seed)
    rank, step = rng.randrange(2), rng.randrange(1, 12)
    job = aiaccrun(2, "torch_elastic.py", str(rank), str(step), "kill", timeout=240,
                   flags=["--max-restarts", "2", "--elastic-dir", str(tmp_path / "commits")])
    assert job.returncode == 0, job.output
    assert _restarted_after_the_kill_of(rank, job.output, "restart 1 of 2"), job.output
    # the commit of the step before the failure may still have been being written (rank 0 writes in the
    # background, one commit at a time): then the one before it is the last complete commit
    after = job.output.split("restart 1 of 2", 1)[1].splitlines()
    resumed = {line.split()[1]: int(line.split("step=")[1]) for line in after if line.startswith("RESUME ")}
    assert set(resumed) == {"rank=0", "rank=1"} and len(set(resumed.values())) == 1, job.output
    assert resumed["rank=0"] in (step - 1, step), (step, job.output)
    for r in (0, 1):
        assert f"OK rank={r} restarts=1" in job.output, job.output  # parameters equal the uninterrupted run
    assert not _leftovers("torch_elastic.py")


def test_a_hosts_updated_interrupt_restarts_the_job_from_the_last_commit(tmp_path):
    """Horovod's HostsUpdatedInterrupt (hvd.elastic's, aiacc.exceptions') raised by a script: the start ends and
    the job resumes from the last commit, to the parameters of an uninterrupted run."""
    need_framework("torch")
    job = aiaccrun(2, "torch_elastic.py", "1", "5", "interrupt", timeout=240,
                   flags=["--max-restarts", "1", "--elastic-dir", str(tmp_path / "commits")])
    assert job.returncode == 0, job.output
    first, _, after = job.output.partition("restart 1 of 1")
    assert "HostsUpdatedInterrupt: the hosts of the job were updated" in first, job.output
    assert re.search(r"RESUME rank=0 step=[45]\n", after), job.output
    for r in (0, 1):
        assert f"OK rank={r} restarts=1" in after, job.output
    assert not _leftovers("torch_elastic.py")


@pytest.mark.parametrize("fail_at", [2, 4])
def test_elastic_sampler_resumes_with_the_samples_the_last_commit_left(tmp_path, fail_at):
    """hvd.elastic.ElasticSampler in a TorchState: rank 1 raises after FAIL_AT batches of epoch 0; the restarted
    job resumes at the committed position, and the batches committed on the first start and those processed
    on the second cover the epoch's 22 samples, none twice; the next epoch covers them all again."""
    need_framework("torch")
    job = aiaccrun(2, "torch_elastic_sampler.py", str(fail_at), timeout=240,
                   flags=["--max-restarts", "1", "--elastic-dir", str(tmp_path / "commits")])
    assert job.returncode == 0, job.output
    first, _, after = job.output.partition("restart 1 of 1")
    assert f"planned failure after {fail_at} batches" in first, job.output
    resumed = {int(m[0]): int(m[1]) for m in re.findall(r"RESUME rank=(\d) start=1 epoch=0 processed=(\d+)", after)}
    # rank 0 writes commits in the background: the last one may not have been complete at the failure
    assert set(resumed) == {0, 1} and resumed[0] == resumed[1] in (4 * fail_at, 4 * (fail_at - 1)), job.output

    def batches(text, start, epoch):
        return {r: [[int(i) for i in m.split(",")] for m in re.findall(
            rf"BATCH rank={r} start={start} epoch={epoch} idx=([\d,]+)", text)] for r in (0, 1)}

    committed = resumed[0] // 4  # batches of each rank in the last commit (2 ranks x 2 samples a batch)
    before = {i for r, bs in batches(first, 0, 0).items() for b in bs[:committed] for i in b}
    later = [i for bs in batches(after, 1, 0).values() for b in bs for i in b]
    assert not before & set(later), (sorted(before), later)
    assert before | set(later) == set(range(22)), (sorted(before), later)
    assert len(before) + len(later) <= 22 + 1, later  # one sample repeated at most: padding for 2 ranks
    epoch1 = [i for bs in batches(after, 1, 1).values() for b in bs for i in b]
    assert sorted(epoch1) == list(range(22)), epoch1
    assert "OK rank=0 start=1 checks=7" in after and "OK rank=1 start=1 checks=7" in after, job.output


def test_torch_state_commit_waits_for_every_optimizer_it_holds():
    """A further optimizer given to TorchState as a keyword stepped while commit()'s background copy ran: its
    update leaked into the commit (restore() gave the parameters after the step; the ranks drifted apart); and a
    parameter changed in place after commit() (outside any optimizer) leaked in the same way."""
    need_framework("torch")
    assert_ok(aiaccrun(2, "torch_elastic_extras.py", timeout=120), 2, checks=5)


def test_torch_state_commit_waits_for_an_optimizer_put_on_the_state_later():
    """``state.optimizer = new`` (a reset callback building the optimizer again): its step() did not wait for
    commit()'s background copy of its state, so restore() gave back the momentum after that step."""
    need_framework("torch")
    assert_ok(aiaccrun(2, "torch_elastic_replaced.py", timeout=120), 2, checks=3)


def test_a_script_whose_last_line_commits_a_torch_state_ends_normally():
    """commit() copies the optimizer's state on a background thread; a script that ended right after its last
    commit (Horovod's elastic ImageNet example does) aborted at exit, ``terminate called without an active
    exception`` and SIGABRT on every rank, because the interpreter ended that thread inside torch's copy."""
    need_framework("torch")
    job = aiaccrun(2, "torch_elastic_exit.py", timeout=120)
    assert_ok(job, 2)
    assert "terminate called" not in job.output, job.output


def test_a_commit_on_the_last_line_of_a_script_is_on_disk_for_the_next_start(tmp_path):
    """A script whose last line commits (after ``hvd.elastic.run`` returned, a TorchState of ~150 MB): rank 0's
    commit writer was a daemon thread, ended at the interpreter's exit in the middle of the file, so the commit
    was left as ``.tmp`` (removed with a warning at the next start) and the next start of the job resumed from
    the commit before it (epoch 0, not 99: seen in 5 of 5 runs). Now the exit waits for the writer: the next
    start resumes every rank from exactly what was committed last."""
    need_framework("torch")
    commits = tmp_path / "commits"
    flags = ["--elastic-dir", str(commits)]
    first = aiaccrun(2, "torch_elastic_last_commit.py", "commit", timeout=180, flags=flags)
    assert_ok(first, 2, marker="COMMITTED")
    committed = re.search(r"COMMITTED rank=0 (epoch=99 sum=\S+)", first.output).group(1)
    left = sorted(os.listdir(commits))
    second = aiaccrun(2, "torch_elastic_last_commit.py", "check", timeout=180, flags=flags)
    assert second.returncode == 0, second.output
    for r in (0, 1):
        assert f"RESUMED rank={r} {committed} " in second.output, (first.output, second.output)
    assert "half-written" not in second.output, second.output
    assert left == ["commit-00000001.aiacc", "commit-00000002.aiacc"], left
    assert not _leftovers("torch_elastic_last_commit.py")
    shutil.rmtree(commits)  # (300 MB)


def test_a_commit_on_the_last_line_of_a_one_process_script_is_on_disk_for_the_next_start(tmp_path):
    """The same without a framework (the core's writer, which the TensorFlow, Keras and MXNet states use too), in
    one plain process: the commit on the script's last line was not even begun (no file; the next start
    resumed from the initial state, step 0). Now it is on disk, and the next start resumes from it."""
    env = {"AIACC_ELASTIC_DIR": str(tmp_path / "commits")}
    first = python("elastic_last_commit.py", "commit", env=env, timeout=120)
    assert first.returncode == 0, first.output
    second = python("elastic_last_commit.py", "check", env=env, timeout=120)
    assert second.returncode == 0, second.output
    assert f"RESUMED rank=0 step=7 total={float(1 << 24)}" in second.output, (first.output, second.output)
    assert os.listdir(tmp_path / "commits") == ["commit-00000001.aiacc"]
    shutil.rmtree(tmp_path / "commits")  # (128 MB)


def test_torch_state_keeps_a_scheduler_and_a_grad_scaler_as_their_state_dicts(tmp_path):
    """A learning-rate scheduler (and a GradScaler) given to TorchState as a keyword was pickled whole: from the
    first sync() in hvd.elastic.run on, state.scheduler was a copy bound to a copy of the optimizer, so stepping
    it left the training's learning rate where it was. Now restore(), sync() and a restart load the committed
    position into the same objects: the schedule resumes where the commit left it, and the parameters equal
    an uninterrupted one-process run."""
    need_framework("torch")
    job = aiaccrun(2, "torch_elastic_stateful.py", "4", timeout=240,
                   flags=["--max-restarts", "1", "--elastic-dir", str(tmp_path / "commits")])
    assert job.returncode == 0, job.output
    first, _, after = job.output.partition("restart 1 of 1")
    for r in (0, 1):
        assert f"SAME OBJECTS rank={r} checks=2" in first, job.output
        assert re.search(rf"RESUME rank={r} step=[34] lr=0.2\n", after), job.output  # StepLR(3, 0.5)
        assert f"OK rank={r} restarts=1 checks=1" in after, job.output


def test_restarts_used_up_end_the_job_with_the_last_failure(tmp_path):
    need_framework("torch")
    job = aiaccrun(2, "torch_elastic.py", "0", "3", "raise", "every", timeout=240,
                   flags=["--max-restarts", "1", "--elastic-dir", str(tmp_path / "commits")])
    assert job.returncode != 0
    assert "restart 1 of 1" in job.output and "RESUME rank=0 step=3" in job.output, job.output
    assert "the job failed 2 times and --max-restarts 1 are used up; last failure:" in job.output, job.output
    assert "injected failure at step 3" in job.output
    assert not _leftovers("torch_elastic.py")


def test_an_elastic_directory_of_another_job_ends_the_job_without_restarts(tmp_path):
    """Commits of a 2-rank job in the directory of a 3-rank one: the error a restart would meet again ends the
    job at once (every restart failed the same way, with the reset callbacks run for nothing)."""
    need_framework("torch")
    flags = ["--max-restarts", "2", "--elastic-dir", str(tmp_path / "commits")]
    first = aiaccrun(2, "torch_elastic.py", "0", "0", "never", timeout=240, flags=flags)
    assert first.returncode == 0, first.output
    job = aiaccrun(3, "torch_elastic.py", "0", "0", "never", timeout=240, flags=flags)
    assert job.returncode != 0
    assert "holds commits of another job" in job.output and "restart 1 of 2" not in job.output, job.output
    assert ("aiaccrun: not starting the job again (--max-restarts): a restart would fail the same way: "
            "ElasticStateError: elastic directory") in job.output, job.output
    assert not _leftovers("torch_elastic.py")


@pytest.mark.parametrize("case", ["a file as the elastic dir", "commit inside tf.function"])
def test_errors_a_restart_would_meet_again_end_the_job_without_restarts(tmp_path, case):
    """An --elastic-dir that is a file was the bare "FileExistsError: ... 'train.py'" from inside run(), and the
    job was started again; a commit inside a tf.function came wrapped in autograph's StagingError, which the
    launcher restarted (the ElasticStateError it wraps says a restart fails the same way). A TensorFlowState
    without variables in eager mode is an error at once (it held none: a restart resumed untrained weights)."""
    if case == "a file as the elastic dir":
        need_framework("torch")
        (tmp_path / "notes.txt").write_text("not a directory")
        job = aiaccrun(2, "torch_elastic.py", "0", "0", "never", timeout=240,
                       flags=["--max-restarts", "2", "--elastic-dir", str(tmp_path / "notes.txt")])
        said = (f"ElasticStateError: the elastic directory '{tmp_path / 'notes.txt'}' (aiaccrun --elastic-dir, "
                "AIACC_ELASTIC_DIR) cannot be used: it is a file, not a directory")
    else:
        need_framework("tensorflow", TENSORFLOW)
        job = aiaccrun(2, "tf_elastic_misuse.py", timeout=240,
                       flags=["--max-restarts", "2", "--elastic-dir", str(tmp_path / "commits")])
        for r in (0, 1):
            assert f"CHECKED rank={r} restarts=0" in job.output, job.output
        said = "ElasticStateError: an elastic state is committed, synced or made eagerly, not inside a tf.function"
    assert job.returncode != 0 and "restart 1 of 2" not in job.output, job.output
    assert f"aiaccrun: not starting the job again (--max-restarts): a restart would fail the same way: {said}" in \
        job.output, job.output
    assert not _leftovers("torch_elastic.py") and not _leftovers("tf_elastic_misuse.py")


def test_a_torch_state_refuses_an_optimizer_of_a_process_set_without_rank_0():
    """A state commits and syncs rank 0's copy of everything it holds: a model trained on a set without rank 0
    came back from a restart as rank 0's untrained copy, without a word. Now an error on every rank, naming it."""
    need_framework("torch")
    assert_ok(aiaccrun(3, "torch_elastic_sets.py", timeout=180), 3, checks=4)


def test_max_restarts_without_an_elastic_dir_is_refused_at_launch():
    job = subprocess.run([sys.executable, "-m", "aiacc.launcher", "-np", "2", "--max-restarts", "1", "true"],
                         capture_output=True, text=True, timeout=60)
    assert job.returncode == 2 and "--max-restarts (AIACC_MAX_RESTARTS) needs --elastic-dir" in job.stderr


def _killed_once_and_resumed(tmp_path, worker: str, rank: int, step, timeout: float, *more: str, env=None):
    """``worker`` (its rank ``rank`` SIGKILLs itself at ``step`` of the first start) restarted once, ends
    with every rank's OK (the final state equals the uninterrupted run) and leaves no process. Returns the job."""
    job = aiaccrun(2, worker, str(rank), str(step), *more, timeout=timeout, env=env,
                   flags=["--max-restarts", "1", "--elastic-dir", str(tmp_path / "commits")])
    assert job.returncode == 0, job.output
    assert _restarted_after_the_kill_of(rank, job.output, "restart 1 of 1"), job.output
    for r in (0, 1):
        assert f"OK rank={r} restarts=1" in job.output, job.output
    assert not _leftovers(worker)
    return job


@pytest.mark.parametrize("how", ["never", "kill"])
def test_two_elastic_phases_each_resume_from_their_own_commits(tmp_path, how):
    """Pretraining then fine-tuning, each ``hvd.elastic.run`` with a TorchState of its own (the second also holds
    a further model and its DistributedOptimizer as keywords). Uninterrupted, the second phase trains all its
    steps (it loaded the first phase's last commit and skipped them, or refused it as another job's); with rank
    1 killed in the second phase, the restarted job replays the first from its last commit and resumes the
    second at its own; both end equal to one process trained on the whole batch without interruption (the
    extra model came back right: it used to be unpickled into a new object the script never saw)."""
    need_framework("torch")
    job = aiaccrun(2, "torch_elastic_phases.py", "1", "1", "3", how, timeout=240,
                   flags=["--max-restarts", "1", "--elastic-dir", str(tmp_path / "commits")])
    assert job.returncode == 0, job.output
    restarts = 1 if how == "kill" else 0
    for r in (0, 1):
        assert f"OK rank={r} restarts={restarts}" in job.output, job.output
    if how == "kill":
        assert _restarted_after_the_kill_of(1, job.output, "restart 1 of 1"), job.output
        after = job.output.split("restart 1 of 1", 1)[1]
        assert "RESUME rank=0 phase=0 step=4" in after, job.output  # the first phase's last commit: done
        resumed = set(re.findall(r"RESUME rank=\d phase=1 step=(\d+)", after))
        assert resumed in ({"3"}, {"2"}), job.output  # (the last commit may still have been being written)
    else:
        assert job.output.count("phase=1 step=0") == 2, job.output
    assert not _leftovers("torch_elastic_phases.py")


def test_a_run_function_called_once_per_epoch_resumes_where_the_job_stopped(tmp_path):
    """``@hvd.elastic.run`` around one epoch, called from the script's epoch loop over one TorchState: each call
    was an elastic phase of its own, so the restarted job replayed every earlier epoch from that epoch's last
    commit (a kill in epoch K cost K epochs) and kept 3 commit files per epoch. The phase is the state now: the
    restart trains the rest of epoch 2 and epoch 3 only, calls the reset callbacks once, and 3 files are kept."""
    need_framework("torch")
    commits = tmp_path / "commits"
    job = aiaccrun(2, "torch_elastic_epochs.py", timeout=240, flags=["--max-restarts", "1", "--elastic-dir", str(commits)])
    assert job.returncode == 0, job.output
    assert _restarted_after_the_kill_of(1, job.output, "restart 1 of 1"), job.output
    after = job.output.split("restart 1 of 1", 1)[1]
    for r in (0, 1):
        assert f"OK rank={r} restarts=1" in job.output, job.output
        # from the last commit (2.2; 2.1 where it was still being written when the job ended) to the end
        steps = re.findall(rf"TRAINED rank={r} restarts=1 resets=1 steps=(\S+)", after)
        assert steps in (["2.2,2.3,3.0,3.1,3.2,3.3"], ["2.1,2.2,2.3,3.0,3.1,3.2,3.3"]), job.output
    assert len([f for f in os.listdir(commits) if f.endswith(".aiacc")]) == 3, os.listdir(commits)
    assert not _leftovers("torch_elastic_epochs.py")


def test_tensorflow_keras_state_resumes_from_the_last_commit(tmp_path):
    need_framework("tensorflow", TENSORFLOW)
    _killed_once_and_resumed(tmp_path, "tf_elastic.py", 1, 4, timeout=280)


@pytest.mark.parametrize("backend", ["tensorflow", "jax", "keras2"])
def test_keras_fit_with_the_elastic_callbacks_resumes_at_the_committed_epoch_and_batch(tmp_path, backend):
    """Keras 3 model.fit (DistributedOptimizer(Adam), CommitStateCallback every 2 batches listed first, as in
    Horovod's documentation): rank 1 is killed before batch 3 of epoch 1. The restarted job resumes at the
    last commit (epoch 1 after 2 batches; the epoch's start if that commit was still being written), trains
    exactly the batches not yet trained, and ends with the weights of the uninterrupted one-process fit. On
    JAX the state first has Keras write its trainer's state back (a commit inside fit read emptied
    variables: "'NoneType' object is not callable", the job aborted). On Keras 2 (tf_keras, TF_USE_LEGACY_KERAS=1)
    the state builds the optimizer before fit, as on Keras 3 (tf_keras' has no ``built``: the first start's commits
    had its slots, the restart's first not, and the restart was refused as "commits of another job")."""
    need_framework("tensorflow", TENSORFLOW)
    if backend == "jax":
        need_framework(backend)
    env = {"TF_USE_LEGACY_KERAS": "1"} if backend == "keras2" else {"KERAS_BACKEND": backend}
    job = _killed_once_and_resumed(tmp_path, "keras_elastic_fit.py", 1, 1, 280, "3",
                                   *(["keras2"] if backend == "keras2" else []), env=env)
    after = job.output.split("restart 1 of 1", 1)[1]
    resumed = {line.split()[1]: tuple(int(w.split("=")[1]) for w in line.split()[2:])
               for line in after.splitlines() if line.startswith("RESUME ")}
    assert set(resumed) == {"rank=0", "rank=1"} and len(set(resumed.values())) == 1, job.output
    epoch, batch = resumed["rank=0"]
    assert (epoch, batch) in ((1, 2), (1, 0)), job.output
    steps, epochs = 6, 3
    for r in (0, 1):  # no batch trained twice, none skipped
        assert f"TRAINED rank={r} batches={epochs * steps - (epoch * steps + batch)}" in after, job.output


@pytest.mark.parametrize("commit_first,steps_per_execution", [(True, 1), (False, 1), (True, 2)])
def test_keras_callbacks_commit_the_position_of_the_committed_weights(commit_first, steps_per_execution):
    """In one process, whatever the order of the callbacks, whether fit counts epochs from 0 (Horovod's
    ``fit(epochs=EPOCHS - state.epoch)``) or from ``initial_epoch``, and with several batches per call of the
    callbacks: every commit's epoch and batch are those of the optimizer's iteration count it holds (one
    every 2 batches), and the state ends at the last epoch with batch 0."""
    need_framework("tensorflow", TENSORFLOW)
    import keras  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    import aiacc.keras as hvd  # noqa: PLC0415

    commits = []

    class Recorded(hvd.elastic.KerasState):
        def commit(self):  # what the commit holds: the position and the optimizer's iteration count
            super().commit()
            iterations = int(self._saved_optimizer[0].numpy())  # Keras 3: the first optimizer variable
            commits.append((self._saved_state["epoch"], self._saved_state["batch"], iterations))

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", steps_per_execution=steps_per_execution)
    state = Recorded(model, epoch=0, batch=0)
    steps = 5
    x, y = np.ones((steps * 2, 3), np.float32), np.zeros((steps * 2, 2), np.float32)
    updates = [hvd.elastic.UpdateBatchStateCallback(state), hvd.elastic.UpdateEpochStateCallback(state)]
    commit = hvd.elastic.CommitStateCallback(state, batches_per_commit=2)
    callbacks = [commit, *updates] if commit_first else [*updates, commit]
    model.fit(x, y, batch_size=2, epochs=2, shuffle=False, verbose=0, callbacks=callbacks)  # counts from 0
    assert (state.epoch, state.batch) == (2, 0)
    state.batch = 2  # as if resumed after 2 batches of epoch 2 (which this model never trained)
    model.fit(x[4:], y[4:], batch_size=2, initial_epoch=2, epochs=3, shuffle=False, verbose=0,
              callbacks=callbacks)  # the rest of epoch 2
    assert (state.epoch, state.batch) == (3, 0)
    model.fit(x, y, batch_size=2, epochs=1, shuffle=False, verbose=0, callbacks=callbacks)  # Horovod's way
    assert (state.epoch, state.batch) == (4, 0)
    assert commits[0] == (0, 2, 2), commits
    for epoch, batch, iterations in commits:
        position = epoch * steps + batch
        assert iterations == position - 2 * (position > 2 * steps), commits
    assert (2, 4, 12) in commits and (3, 0, 13) in commits, commits
    assert commits[-1] == (4, 0, 18), commits


def test_sigterm_to_the_launcher_ends_every_rank_and_restarts_nothing(tmp_path):
    """SIGTERM to aiaccrun (with restarts allowed) ends both ranks within seconds, exits non-zero, does not
    start the job again and leaves no process behind."""
    import signal  # noqa: PLC0415
    import time  # noqa: PLC0415

    marker = f"aiacc-sigterm-{os.getpid()}"
    script = ("import sys, time, numpy, aiacc; aiacc.init(); x = numpy.ones(4); "
              "[aiacc.allreduce(x, name='x') for _ in range(3)]; print('RUNNING', flush=True); "
              "[(aiacc.allreduce(x, name='x'), time.sleep(0.01)) for _ in range(100000)]")
    proc = subprocess.Popen([sys.executable, "-m", "aiacc.launcher", "-np", "2", "--max-restarts", "3",
                             "--elastic-dir", str(tmp_path), sys.executable, "-c", script, marker],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"), start_new_session=True)
    try:
        seen = 0
        deadline = time.monotonic() + 60
        while seen < 2 and time.monotonic() < deadline:
            line = proc.stdout.readline()
            seen += line.count("RUNNING")  # (the ranks' lines may run together)
            if not line:
                break
        assert seen == 2, "the job did not start"
        proc.send_signal(signal.SIGTERM)
        start = time.monotonic()
        out, _ = proc.communicate(timeout=30)
        took = time.monotonic() - start
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0, out
    assert "starting it again" not in out, out
    assert took < 30
    assert not _leftovers(marker), "a rank survived the launcher"


def test_sigterm_to_the_launcher_while_a_commit_is_written_leaves_the_last_complete_one(tmp_path):
    """SIGTERM to aiaccrun while rank 0 is in the middle of writing a commit: every rank ends, the status is
    non-zero, nothing is restarted and no process is left; the half-written commit never counts. A second
    launch on the same directory removes it and resumes from the last complete commit.

    The commit of step 3 is held in the middle deterministically: the test makes its temporary file a named
    pipe (a disk that stalls), reads the first bytes the writer sends (so the write has begun) and then no
    more, so the writer is blocked in write() when the signal comes, whatever the machine's speed."""
    import select
    import signal
    import threading
    import time

    commits = tmp_path / "commits"
    commits.mkdir()
    hold = tmp_path / "go"
    proc = subprocess.Popen([sys.executable, "-m", "aiacc.launcher", "-np", "2", "--max-restarts", "2",
                             "--elastic-dir", str(commits), sys.executable, str(WORKERS / "elastic_sigterm.py"),
                             str(hold)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=base_env(),
                            start_new_session=True)
    watchdog = threading.Timer(180, os.killpg, (proc.pid, signal.SIGKILL))  # a hang fails, never waits
    watchdog.start()
    try:
        lines = []
        for line in proc.stdout:  # ends at EOF if the job fails early
            lines.append(line)
            if line.startswith("WAITING rank=0"):
                break
        assert lines and lines[-1].startswith("WAITING"), "".join(lines)
        torn = commits / "commit-00000003.aiacc.tmp"  # the commit of step 3 (a fresh directory: seq == step)
        os.mkfifo(torn)
        hold.touch()
        fd = os.open(torn, os.O_RDONLY | os.O_NONBLOCK)  # the writer opens the pipe when it starts the commit
        head = b""
        deadline = time.monotonic() + 60
        while len(head) < 4096 and time.monotonic() < deadline:
            if select.select([fd], [], [], 1.0)[0]:
                try:
                    got = os.read(fd, 4096 - len(head))
                except BlockingIOError:  # a writer opened the pipe after select saw none (EOF): no data yet
                    got = b""
                head += got
                if not got:  # no writer yet, or none of its bytes yet (the direct-I/O probe opens it first)
                    time.sleep(0.05)
        assert head.startswith(b"AIACC-COMMIT-2\n"), head[:40]  # the writer is inside commit 3, now stalled
        # commit() returns while its write is stalled (the write goes on in the background): the signal comes
        # once rank 0 has said so (sent at once, it could overtake that line on a loaded machine); a commit()
        # that waited for its write would never say it: the watchdog ends the job and the asserts below fail
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("COMMIT rank=0 step=3"):
                break
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=60)
        os.close(fd)
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = "".join(lines) + rest
    assert proc.returncode != 0, out
    assert "starting it again" not in out, out
    assert not _leftovers("elastic_sigterm.py"), "a rank survived the launcher"
    assert "COMMIT rank=0 step=3" in out  # commit() returned: the write goes on in the background
    assert sorted(p.name for p in commits.iterdir()) == [
        "commit-00000001.aiacc", "commit-00000002.aiacc", "commit-00000003.aiacc.tmp"], out
    torn.unlink()
    torn.write_bytes(head)  # what a disk holds of a commit torn by the end of the job: a regular file

    job = aiaccrun(2, "elastic_sigterm.py", timeout=120, flags=["--elastic-dir", str(commits)])
    assert job.returncode == 0, job.output
    assert "removing" in job.output and "commit-00000003.aiacc.tmp" in job.output, job.output
    for r in (0, 1):
        assert f"RESUME rank={r} step=2" in job.output, job.output  # the last complete commit
        assert f"OK rank={r}" in job.output, job.output  # and the state continued from it exactly
    assert "skipping damaged commit" not in job.output, job.output  # the torn file was never read
    assert sorted(p.name for p in commits.iterdir()) == [
        "commit-00000004.aiacc", "commit-00000005.aiacc", "commit-00000006.aiacc"], job.output


def test_background_commit_work_runs_at_idle_priority_and_leaves_the_caller_alone():
    """``idle_priority()`` (the TorchState copy thread calls it) puts the calling thread, and only it, in
    Linux's SCHED_IDLE class: it runs on cores that training leaves idle."""
    import threading

    from aiacc.elastic import idle_priority

    seen = {}

    def background():
        idle_priority()
        seen["policy"] = os.sched_getscheduler(0)

    thread = threading.Thread(target=background)
    thread.start()
    thread.join()
    assert seen["policy"] == os.SCHED_IDLE
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the calling (training) thread is untouched


def test_torch_state_commit_is_the_state_at_commit_although_copied_in_the_background():
    """TorchState copies parameters and optimizer state on a thread while the next forward/backward run;
    step() waits for that copy, so restore() returns exactly to the committed values (a model large enough
    that the copy is still running when step() is called)."""
    need_framework("torch")
    import torch  # noqa: PLC0415

    from aiacc.torch.elastic import TorchState  # noqa: PLC0415

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.BatchNorm1d(1024), torch.nn.Linear(1024, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    state = TorchState(model=model, optimizer=opt, step=0)
    x = torch.randn(16, 1024)
    for step in range(3):
        state.commit()
        want = {k: v.clone() for k, v in model.state_dict().items()}
        want_momentum = [opt.state[p]["momentum_buffer"].clone() for p in model.parameters() if p in opt.state]
        opt.zero_grad()
        model(x).square().mean().backward()  # changes BatchNorm's statistics (copied at commit)
        opt.step()  # waits for the background copy before it changes the parameters
        state.restore()
        for k, v in model.state_dict().items():
            assert torch.equal(v, want[k]), (step, k)
        got_momentum = [opt.state[p]["momentum_buffer"] for p in model.parameters() if p in opt.state]
        assert len(got_momentum) == len(want_momentum)
        assert all(torch.equal(a, b) for a, b in zip(got_momentum, want_momentum))


def test_torch_state_names_the_keyword_and_what_it_takes_for_a_value_of_another_kind():
    """``TorchState(model=optimizer)`` (keywords swapped, a dict, the model's class) failed deep inside with
    ``Optimizer.state_dict() got an unexpected keyword argument 'keep_vars'`` or an AttributeError; now a
    TypeError names the keyword, what it takes and what it got, at construction and at ``state.x = ...``."""
    need_framework("torch")
    import torch

    from aiacc.torch.elastic import TorchState

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cases = [(dict(model=opt), ["model=", "torch.nn.Module", "SGD", "optimizer="]),
             (dict(model=model, optimizer=model), ["optimizer=", "torch.optim.Optimizer", "Linear", "model="]),
             (dict(model={"w": 1}), ["model=", "torch.nn.Module", "dict"]),
             (dict(model=torch.nn.Linear), ["model=", "an instance", "not the class"])]
    for kwargs, words in cases:
        with pytest.raises(TypeError) as info:
            TorchState(**kwargs)
        assert all(w in str(info.value) for w in words), (kwargs, str(info.value))
    state = TorchState(model=model, optimizer=opt, disc=torch.nn.Linear(2, 2), epoch=0)
    with pytest.raises(TypeError, match=r"optimizer= takes a torch.optim.Optimizer.*Linear"):
        state.optimizer = model
    with pytest.raises(TypeError, match=r"state.disc .*state_dict\(\).*int"):
        state.disc = 3
    assert state.optimizer is opt  # (refused: nothing changed)


def test_torch_state_saves_a_model_or_optimizer_set_on_it_at_once():
    """``state.model = new_model`` (and the optimizer, a further model keyword) is saved when it is set, as in
    Horovod: before, ``restore()`` before the next commit loaded the old model's committed weights into the new
    model (or failed on another architecture) and the old optimizer's momentum into the new optimizer."""
    need_framework("torch")
    import torch

    from aiacc.torch.elastic import TorchState

    torch.manual_seed(0)

    def make(n):
        model = torch.nn.Sequential(torch.nn.Linear(n, n), torch.nn.Linear(n, 2))
        return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def train(model, opt, n):
        opt.zero_grad()
        model(torch.ones(4, n)).square().mean().backward()
        opt.step()

    model, opt = make(4)
    disc = torch.nn.Linear(3, 1)
    state = TorchState(model=model, optimizer=opt, disc=disc, epoch=0)
    train(model, opt, 4)
    state.commit()
    for n in (4, 6):  # the same architecture, then another one
        model, opt = make(n)
        train(model, opt, n)  # the new optimizer has momentum of its own
        state.model, state.optimizer, state.disc = model, opt, torch.nn.Linear(3, 1)
        want = [p.detach().clone() for p in model.parameters()]
        want_momentum = [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()]
        want_disc = state.disc.weight.detach().clone()
        train(model, opt, n)
        with torch.no_grad():
            state.disc.weight.add_(1.0)
        state.restore()
        assert all(torch.equal(p, w) for p, w in zip(model.parameters(), want)), n
        assert all(torch.equal(opt.state[p]["momentum_buffer"], w) for p, w in zip(model.parameters(), want_momentum))
        assert torch.equal(state.disc.weight, want_disc), n
        assert state.model is model and state.optimizer is opt


def test_torch_state_restores_one_commit_as_often_as_asked():
    """Steps after a restore() do not change the commit: a second restore() returns to the same parameters
    and momentum (torch's load_state_dict adopts the saved tensors; the state must hand it a copy), also
    once commits reuse the memory of earlier ones."""
    need_framework("torch")
    import torch

    from aiacc.torch.elastic import TorchState

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    state = TorchState(model=model, optimizer=opt)
    x = torch.randn(4, 8)

    def step():
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()

    for _ in range(4):  # commits that reuse the copies of earlier ones
        step()
        state.commit()
    want = [p.detach().clone() for p in model.parameters()]
    want_momentum = [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    for attempt in range(3):
        step()
        step()
        state.restore()
        assert all(torch.equal(p, w) for p, w in zip(model.parameters(), want)), attempt
        momentum = [opt.state[p]["momentum_buffer"] for p in model.parameters()]
        assert all(torch.equal(m, w) for m, w in zip(momentum, want_momentum)), attempt


def test_mxnet_state_resumes_from_the_last_commit(tmp_path):
    need_framework("mxnet")
    _killed_once_and_resumed(tmp_path, "mx_elastic.py", 0, 6, timeout=240)


# ---- --host-discovery-script, --min-np, --max-np ----------------------------------------------------------

def _script(tmp_path, name: str, body: str) -> str:
    path = tmp_path / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return str(path)


def _aiaccrun_discovering(script: str, *flags: str, command=(), timeout: float = 120):
    """``aiaccrun --host-discovery-script SCRIPT [flags] COMMAND`` (no -np)."""
    return run_job([sys.executable, "-m", "aiacc.launcher", "--host-discovery-script", script, *flags, *command],
               timeout=timeout)


def test_a_restart_runs_on_the_hosts_discovered_then_and_resumes_at_the_new_world_size(tmp_path):
    """The discovery script reports localhost:2 for the first start and localhost:3 after; rank 1 is killed
    at step 5 of the first start. The job restarts with 3 ranks, resumes from the commit the 2 ranks wrote,
    and ends with the parameters of the uninterrupted run (the global batch of 12 is split across the ranks)."""
    need_framework("torch")
    script = _script(tmp_path, "hosts.sh", 'if [ "$AIACC_RESTART_COUNT" = 0 ]; then echo localhost:2; '
                                           'else echo "# grown"; echo localhost:3; fi\n')
    job = _aiaccrun_discovering(script, "--min-np", "2", "--max-np", "3", "--max-restarts", "1",
                                "--elastic-dir", str(tmp_path / "commits"),
                                command=[sys.executable, str(WORKERS / "torch_elastic.py"), "1", "5", "kill"],
                                timeout=300)
    assert job.returncode == 0, job.output
    first, _, after = job.output.partition("restart 1 of 1")
    assert "aiaccrun: start 0: 2 ranks on localhost:2" in first and "rank 1 was killed by signal 9" in first
    assert "START rank=2" not in first, job.output
    assert "aiaccrun: start 1: 3 ranks on localhost:3" in after, job.output
    resumed = {line.split()[1]: int(line.split("step=")[1]) for line in after.splitlines()
               if line.startswith("RESUME ")}
    assert set(resumed) == {"rank=0", "rank=1", "rank=2"} and len(set(resumed.values())) == 1, job.output
    # the last complete commit of the 2 ranks: step 5's or 4's, or earlier where the kill caught rank 0 writing
    # one (a loaded machine: it says it removed that half-written commit, and resumes from the one before)
    half = re.search(r"commit-0*(\d+)\.aiacc\.tmp, a commit the previous job left half-written", after)
    assert resumed["rank=0"] in ((int(half.group(1)) - 1,) if half else (4, 5)), job.output
    assert "resumes from the last commit" in after and "(3 ranks)" in after, job.output
    # the reset callbacks ran on every rank of the new start (none on the first), rank 0's after its load
    assert "RESET" not in first and f"RESET rank=0 size=3 step={resumed['rank=0']}" in after, job.output
    assert "RESET rank=1 size=3" in after and "RESET rank=2 size=3" in after, job.output
    for r in (0, 1, 2):
        assert f"OK rank={r} restarts=1" in after, job.output  # parameters equal the uninterrupted run
    assert not _leftovers("torch_elastic.py")


def test_a_new_job_that_resumes_an_earlier_ones_commit_at_another_size_calls_the_reset_callbacks(tmp_path):
    """A job of 3 ranks fails at step 5 with no restart left; a new aiaccrun on the same --elastic-dir finds 2
    slots and resumes the commit: its reset callbacks run on every rank (none ran: Horovod's learning-rate
    rescale kept the 3-rank rate) and training ends equal to the uninterrupted run."""
    need_framework("torch")
    commits = str(tmp_path / "commits")
    for slots, how in ((3, "raise"), (2, "never")):
        script = _script(tmp_path, f"hosts{slots}.sh", f"echo localhost:{slots}\n")
        job = _aiaccrun_discovering(script, "--min-np", "2", "--max-np", "3", "--max-restarts", "0",
                                    "--elastic-dir", commits, command=[sys.executable, str(WORKERS / "torch_elastic.py"),
                                                                       "1", "5", how], timeout=240)
        if slots == 3:
            assert job.returncode != 0 and "injected failure at step 5" in job.output, job.output
            assert "RESET" not in job.output, job.output
    assert job.returncode == 0, job.output
    resumed = int(job.output.split("RESUME rank=0 step=")[1].split()[0])
    assert resumed in (4, 5) and "resumes from the last commit" in job.output, job.output
    for r in (0, 1):
        assert f"RESET rank={r} size=2" in job.output and f"OK rank={r} restarts=0" in job.output, job.output
    assert not _leftovers("torch_elastic.py")


def test_a_start_waits_for_min_np_slots_asking_the_script_again(tmp_path):
    """The script finds 1 slot on its first call and 2 on the next: the start waits (saying so) and then runs
    2 ranks; -np is not needed."""
    calls = tmp_path / "calls"
    script = _script(tmp_path, "hosts.sh", f'echo x >> {calls}\n'
                                           f'if [ "$(wc -l < {calls})" -lt 2 ]; then echo localhost:1; '
                                           'else echo localhost:2; fi\n')
    job = _aiaccrun_discovering(script, "--min-np", "2", "--elastic-timeout", "120",
                                command=["sh", "-c", 'echo "RANK $RANK OF $WORLD_SIZE"'])
    assert job.returncode == 0, job.output
    assert "waiting for 2 slots" in job.output and "found 1 (localhost:1)" in job.output, job.output
    assert "RANK 0 OF 2" in job.output and "RANK 1 OF 2" in job.output, job.output
    assert calls.read_text().count("x") == 2


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGINT"])
def test_a_signal_while_a_restart_waits_for_hosts_ends_the_launcher_and_starts_nothing(tmp_path, signame):
    """The first start fails; the restart waits for the script's 2 slots. SIGTERM (or Ctrl-C) to aiaccrun there was
    only recorded for an mpiexec that no longer ran: once the hosts were back the job started again and ran in
    full. Now aiaccrun ends at once with 128 + the signal, saying so, and starts nothing."""
    import signal  # noqa: PLC0415
    import time  # noqa: PLC0415

    waiting, back = tmp_path / "waiting", tmp_path / "back"
    script = _script(tmp_path, "hosts.sh", f'if [ "$AIACC_RESTART_COUNT" = 0 ] || [ -e {back} ]; then '
                                           f'echo localhost:2; else touch {waiting}; echo localhost:1; fi\n')
    proc = subprocess.Popen([sys.executable, "-m", "aiacc.launcher", "--host-discovery-script", script, "--min-np", "2",
                             "--max-restarts", "1", "--elastic-dir", str(tmp_path / "commits"), "--elastic-timeout",
                             "60", "sh", "-c", "exit 3"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=base_env(), start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not waiting.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert waiting.exists(), "the restart never waited for hosts"
        proc.send_signal(getattr(signal, signame))
        back.touch()  # (the hosts are back: a launcher that went on would start the job again now)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 128 + getattr(signal, signame), out
    assert f"aiaccrun: stopped by {signame} before the job's next start (no rank is running)" in out, out
    assert "restart 1 of 1" in out and "start 1:" not in out and "Traceback" not in out, out


def test_too_few_slots_until_the_elastic_timeout_is_an_error_naming_script_slots_and_min_np(tmp_path):
    script = _script(tmp_path, "hosts.sh", "echo localhost:1\n")
    job = _aiaccrun_discovering(script, "--min-np", "2", "--elastic-timeout", "1", command=["true"])
    assert job.returncode == 2, job.output
    assert (f"--host-discovery-script '{script}' found 1 slot (localhost:1) and still no more after 1 s "
            "(--elastic-timeout); --min-np 2 needs at least 2") in job.output, job.output


def test_a_horovod_elastic_command_line_without_max_restarts_says_a_failure_ends_the_job(tmp_path):
    # `horovodrun -np 2 --host-discovery-script hosts.sh ...` restarts failed ranks; as aiaccrun's command line it
    # ran once and a failure ended the job without a word on why nothing restarted
    script = _script(tmp_path, "hosts.sh", "echo localhost:2\n")
    job = _aiaccrun_discovering(script, "-np", "2", command=["sh", "-c", "exit 3"])
    assert job.returncode == 3, job.output
    assert ("--host-discovery-script without --max-restarts: the hosts are discovered at this start only, and a "
            "rank that fails ends the job (horovodrun's elastic mode would restart it); for that give --max-restarts "
            "N --elastic-dir DIR") in job.output, job.output
    job = _aiaccrun_discovering(script, "-np", "2", "--max-restarts", "1", "--elastic-dir", str(tmp_path / "c"),
                                command=["true"])
    assert job.returncode == 0 and "without --max-restarts" not in job.output, job.output


def test_horovods_elastic_timeout_variable_bounds_the_wait_for_min_np_slots(tmp_path):
    # HOROVOD_ELASTIC_TIMEOUT (Horovod's elastic docs: "default: 600 seconds") was not read: the start waited 600 s
    script = _script(tmp_path, "hosts.sh", "echo localhost:1\n")
    job = run_job([sys.executable, "-m", "aiacc.launcher", "--host-discovery-script", script, "--min-np", "2", "true"],
                  env={"HOROVOD_ELASTIC_TIMEOUT": "1"}, timeout=60)
    assert job.returncode == 2, job.output
    assert (f"--host-discovery-script '{script}' found 1 slot (localhost:1) and still no more after 1 s "
            "(HOROVOD_ELASTIC_TIMEOUT); --min-np 2 needs at least 2") in job.output, job.output


def test_a_discovery_script_that_fails_at_a_restart_is_asked_again_not_the_end_of_the_job(tmp_path):
    """Horovod's elastic docs: only the first call of the discovery script is fatal, later errors are retried. The
    script fails once at the restart (its second call; the job ended there with a restart unused): aiaccrun says
    so, asks again and restarts the job on what the third call finds."""
    calls = tmp_path / "calls"
    script = _script(tmp_path, "hosts.sh", f'echo x >> {calls}\n'
                                           f'if [ "$(wc -l < {calls})" = 2 ]; then echo "cloud API unreachable" >&2; '
                                           'exit 1; fi\necho localhost:2\n')
    job = _aiaccrun_discovering(script, "--max-restarts", "1", "--elastic-dir", str(tmp_path / "commits"),
                                command=["sh", "-c", 'echo "RANK $RANK START $AIACC_RESTART_COUNT"; '
                                         'test "$AIACC_RESTART_COUNT" = 1'])
    assert job.returncode == 0, job.output
    assert (f"aiaccrun: --host-discovery-script '{script}' exited with status 1: cloud API unreachable; asking "
            "again every 1 s for up to 600 s (--elastic-timeout)") in job.output, job.output
    assert "aiaccrun: start 1: 2 ranks on localhost:2" in job.output and "RANK 1 START 1" in job.output, job.output
    assert calls.read_text().count("x") == 3
    # one that keeps failing: an error naming the script and its failure once the timeout has passed
    script = _script(tmp_path, "down.sh", 'if [ "$AIACC_RESTART_COUNT" = 1 ]; then echo "API down" >&2; exit 4; fi\n'
                                          'echo localhost:1\n')
    job = _aiaccrun_discovering(script, "--max-restarts", "1", "--elastic-dir", str(tmp_path / "c2"),
                                "--elastic-timeout", "2", command=["false"])
    assert job.returncode == 2, job.output
    assert (f"aiaccrun: error: --host-discovery-script '{script}' exited with status 4: API down, and still after 2 s "
            "(--elastic-timeout)") in job.output, job.output


def test_a_discovery_script_runs_through_the_shell_and_a_host_given_twice_counts_once(tmp_path):
    """As horovodrun (its script runs through the shell; duplicate lines count once): `sh hosts.sh` of a file
    that is not executable works, and `localhost:2` printed twice starts 2 ranks (4 were started on 2 slots)."""
    body = tmp_path / "hosts.sh"
    body.write_text("echo localhost:2\necho localhost:2\n")
    job = _aiaccrun_discovering(f"sh {body}", command=["sh", "-c", 'echo "RANK $RANK OF $WORLD_SIZE"'])
    assert job.returncode == 0, job.output
    assert "start 0: 2 ranks on localhost:2 " in job.output and "RANK 1 OF 2" in job.output, job.output
    # Horovod's documented `--host-discovery-script discover_hosts.sh` of a script in the directory: not a command
    job = run_job(["sh", "-c", f"cd {tmp_path} && chmod +x hosts.sh && exec {sys.executable} -m aiacc.launcher "
                   "--host-discovery-script hosts.sh true"], timeout=60)
    assert job.returncode == 2, job.output
    assert ("--host-discovery-script 'hosts.sh' cannot be run: " in job.output
            and "(a script in this directory runs as ./hosts.sh, as any command)" in job.output), job.output


@pytest.mark.parametrize("body,words", [
    ("echo 'cloud API unreachable' >&2; exit 3\n", ["exited with status 3: cloud API unreachable"]),
    ("echo localhost:2; echo 'node-b two'\n", ["printed 'node-b two' on line 2", "expected host:slots"]),
    ("echo localhost:0\n", ["printed 'localhost:0' on line 1"]),
    ("echo localhost:2; echo localhost:3\n", ["printed host 'localhost' twice, with 2 and 3 slots"]),
])
def test_a_discovery_script_that_fails_or_prints_garbage_is_named(tmp_path, body, words):
    script = _script(tmp_path, "hosts.sh", body)
    job = _aiaccrun_discovering(script, command=["true"])
    assert job.returncode == 2, job.output
    assert f"aiaccrun: error: --host-discovery-script '{script}'" in job.output, job.output
    for w in words:
        assert w in job.output, job.output


@pytest.mark.parametrize("flags,message", [
    (["true"], "-np N is required (or --host-discovery-script"),
    (["-np", "2", "--min-np", "2", "true"], "--min-np applies only with --host-discovery-script"),
    (["--host-discovery-script", "/bin/true", "--min-np", "4", "--max-np", "3", "true"],
     "--min-np 4 is more than --max-np 3"),
    (["--host-discovery-script", "/bin/true", "-np", "4", "--max-np", "3", "true"],
     "--min-np 4 (from -np) is more than --max-np 3"),
    (["--host-discovery-script", "/bin/true", "-np", "4", "--min-np", "2", "--max-np", "3", "true"],
     "-np 4 is more than --max-np 3"),
    (["--host-discovery-script", "/bin/true", "-H", "a:2", "true"], "leave out -H/--hostfile"),
    (["--host-discovery-script", "/nonexistent/hosts.sh", "true"], "'/nonexistent/hosts.sh' cannot be run"),
])
def test_inconsistent_discovery_flags_are_refused_at_launch(flags, message):
    job = run_job([sys.executable, "-m", "aiacc.launcher", *flags], timeout=60)
    assert job.returncode == 2 and message in job.output, job.output


def test_recovery_benchmark_prints_its_figures():
    """`python -m aiacc.bench recovery` (its own jobs, not under aiaccrun): a killed run ends equal to the
    uninterrupted one, and the commit cost lines are printed for a file and for memory."""
    need_framework("torch")
    from conftest import run  # noqa: PLC0415

    job = run([sys.executable, "-m", "aiacc.bench", "recovery", "--runs", "1", "--state-mb", "1", "--repeats", "1"],
              timeout=300)
    assert job.returncode == 0, job.output
    assert "runs=1 equal=1 median_recovery_s=" in job.output, job.output
    for where in ("file", "memory"):
        assert re.search(rf"commit to={where} compute=cpu state_mb=1\.\d step_ms=\S+ .*commit_cost=", job.output), \
            job.output


def test_recovery_benchmark_times_commits_on_a_compute_replay():
    """`--compute PROFILE`: the commit-cost job trains the compute replay of a profile (its parameters are the
    state; layers sleep), and names the compute it used; an unknown profile is refused naming it."""
    need_framework("torch")
    from conftest import run  # noqa: PLC0415

    job = run([sys.executable, "-m", "aiacc.bench", "recovery", "--runs", "0", "--repeats", "1", "--compute", "cnn",
               "--dilate", "0.2"], timeout=300)
    assert job.returncode == 0, job.output
    for where in ("file", "memory"):
        assert re.search(rf"commit to={where} compute=cnn state_mb=\d+\.\d step_ms=\S+ .*commit_cost=", job.output), \
            job.output
    bad = run([sys.executable, "-m", "aiacc.bench", "recovery", "--runs", "0", "--compute", "resnet51"], timeout=60)
    assert bad.returncode == 2 and "--compute" in bad.output and "resnet51" in bad.output, bad.output
