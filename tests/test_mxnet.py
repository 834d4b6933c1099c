"""aiacc.mxnet (MXNet 1.9.1) on real 2-rank jobs, against single-process references.

Few launches on purpose (every MXNet process spends seconds importing it):
one job for the collectives and the Module API, one for Gluon training
(broadcast, five optimizer setups, the overlap timeline, the mismatch error, a failing backward),
one plain process for the disabled switch, the example, and the benchmark.
"""

import json
import re
import sys

import pytest

from conftest import ROOT, aiaccrun, assert_ok, python, run


def _mxnet_installed() -> bool:
    # find_spec, not importorskip: importing mxnet here would fail before aiacc.mxnet restores numpy.bool
    import importlib.util

    return importlib.util.find_spec("mxnet") is not None


pytestmark = pytest.mark.skipif(not _mxnet_installed(), reason="mxnet is not installed (pip install -e '.[mxnet]')")

MX_ENV = {"MXNET_CPU_WORKER_NTHREADS": "1", "OMP_NUM_THREADS": "1"}


def test_ndarray_collectives_module_api_and_errors_match_numpy():
    job = aiaccrun(2, "mx_collectives.py", env=MX_ENV, timeout=240)
    assert_ok(job, 2)
    for r in range(2):
        assert f"COLLECTIVES_OK rank={r}" in job.output and f"MODULE_OK rank={r}" in job.output, job.output
        assert len([line for line in job.lines("ERROR_OK") if f"rank={r}" in line]) == 8, job.output


def _spans(path):
    events = json.loads(path.read_text())
    tracks = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "thread_name"}
    spans = {}
    for e in events:
        if e.get("ph") == "X":
            spans.setdefault((tracks[e["tid"]], e["name"]), []).append(e["ts"])
    return {k: sorted(v) for k, v in spans.items()}


def test_distributed_trainer_matches_one_process_and_overlaps_backward(tmp_path):
    timeline = tmp_path / "mx.json"
    job = aiaccrun(2, "mx_trainer.py", env=MX_ENV, flags=["--timeline", str(timeline), "--timeline-all-ranks"],
                   timeout=300)
    assert_ok(job, 2)
    for r in range(2):
        assert f"BROADCAST_OK rank={r}" in job.output, job.output
        assert len([x for x in job.lines("TRAIN_OK") if f"rank={r}" in x]) == 5, job.output
        assert f"MISMATCH_OK rank={r}" in job.output and f"BCAST_MISMATCH_OK rank={r}" in job.output, job.output
        assert f"BACKWARD_ERROR_OK rank={r}" in job.output, job.output  # an error, not a hang
    # the mismatch error names the tensor and what each rank had
    assert re.search(r"tensor 'grad\.mismatch_(weight|bias)'.*rank 0: \(4.*rank 1: \(5", job.output), job.output

    # Overlap: each gradient is submitted as soon as MXNet has computed it (MXNet finishes them a
    # bulk segment at a time, output layers first); the engine must already be communicating the
    # output layer's gradient while the input layer's weight gradient is still being computed.
    # Communication needs both ranks, and on a busy machine one rank can be behind by a whole
    # segment in a step; the rank that is behind sees its early gradients agreed at once, so
    # every rank's timeline is checked and one overlapped step on one rank is the proof.
    deep = re.search(r"DEEP_OK rank=0 first=(\S+) last=(\S+) steps=(\d+)", job.output)
    first, last, steps = deep.group(1), deep.group(2), int(deep.group(3))
    overlapped, seen = [], []
    for r in range(2):
        spans = _spans(timeline.with_name(f"{timeline.name}.rank{r}"))
        submit_input_layer = spans[(f"grad.{first}", "queued")]
        submit_output_layer = spans[(f"grad.{last}", "queued")]
        comm_output_layer = spans[(f"grad.{last}", "communicate")]
        assert len(submit_input_layer) == len(comm_output_layer) == steps
        assert all(o < i for o, i in zip(submit_output_layer, submit_input_layer)), "not submitted in backward order"
        overlapped += [(r, k) for k in range(steps) if comm_output_layer[k] < submit_input_layer[k]]
        seen.append((comm_output_layer, submit_input_layer))
    assert overlapped, f"communication never started before the last gradient was submitted: {seen}"


def test_disabled_wrappers_are_mxnet_own_bit_for_bit():
    job = python("mx_disabled.py", env=MX_ENV, timeout=180)
    assert_ok(job, 1)
    assert "TRAINER_SAME opt=sgd" in job.output and "TRAINER_SAME opt=adam" in job.output, job.output


def test_digits_example_reaches_95_percent_on_2_ranks():
    job = aiaccrun(2, str(ROOT / "examples" / "mxnet_digits.py"), env=MX_ENV, timeout=300)
    assert job.returncode == 0, job.output
    accuracies = [float(a) for a in re.findall(r"test accuracy (\d\.\d+)", job.output)]
    assert accuracies and accuracies[-1] >= 0.95, job.output


def test_train_benchmark_reports_aiacc_and_mxnet_dist_sync():
    cmd = [sys.executable, "-m", "aiacc.launcher", "-np", "2", sys.executable, "-m", "aiacc.bench", "train",
           "--framework", "mxnet", "--model", "cnn", "--batch-size", "8", "--steps", "2", "--warmup", "1",
           "--repeats", "1", "--json"]
    job = run(cmd, env=MX_ENV, timeout=300)
    assert job.returncode == 0, job.output
    rows = [json.loads(line) for line in job.output.splitlines() if line.startswith("{")]
    modes = {row["mode"]: row for row in rows}
    assert set(modes) == {"compute", "aiacc", "aiacc-no-overlap", "mxnet-dist_sync"}, job.output
    assert all(row["samples/s"] > 0 and row["ranks"] == 2 for row in rows), rows
