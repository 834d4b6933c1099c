"""aiacc.tensorflow and aiacc.keras on real 2-rank jobs (TensorFlow 2.21, Keras 3).

TensorFlow takes seconds to import, so each job checks many things (see the worker docstrings).
"""

import collections
import json
import re
import sys

import pytest

from conftest import ROOT, assert_ok, aiaccrun, python, run

pytest.importorskip("tensorflow")
pytest.importorskip("keras")

TF_TIMEOUT = 280


def test_collectives_gradients_sparse_zero_copy_and_errors_eager_and_in_tf_function():
    assert_ok(aiaccrun(2, "tf_ops.py", timeout=TF_TIMEOUT), 2)


def _overlap_by_step(path, prefix):
    """Per training step: (first submit, last submit, first 'communicate' start) of tensors ``prefix.*``."""
    events = json.loads(path.read_text())
    tracks = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "thread_name"}
    spans = collections.defaultdict(lambda: collections.defaultdict(list))
    for e in events:
        if e.get("ph") == "X" and tracks.get(e["tid"], "").startswith(prefix):
            spans[tracks[e["tid"]]][e["name"]].append(e["ts"])
    assert spans, f"no tensor named {prefix}* in the timeline"
    steps = min(len(phases["queued"]) for phases in spans.values())
    out = []
    for k in range(steps):  # a name occurs once per step, in order
        submits = [phases["queued"][k] for phases in spans.values()]
        comms = [phases["communicate"][k] for phases in spans.values()]
        out.append((min(submits), max(submits), min(comms)))
    return out


def test_custom_loop_matches_one_process_and_sends_gradients_while_backprop_runs(tmp_path):
    timeline = tmp_path / "loop.json"
    job = aiaccrun(2, "tf_loop.py", "8", env={"AIACC_TIMELINE": str(timeline)}, timeout=TF_TIMEOUT)
    assert_ok(job, 2)
    steps = _overlap_by_step(timeline, "overlap.")
    assert len(steps) == 8, steps
    # Overlap: in some step, a gradient was already being communicated before the last gradient of that
    # step (the first layer's) had even been handed to the engine.
    early = [(last - comm) / 1e3 for first, last, comm in steps if comm < last]
    assert early, f"no step communicated before its last gradient was submitted: {steps}"


def test_model_fit_with_distributed_optimizer_and_callbacks():
    assert_ok(aiaccrun(2, "tf_fit.py", timeout=TF_TIMEOUT), 2)


def test_disabled_returns_the_users_objects_and_changes_nothing():
    assert_ok(python("tf_disabled.py", timeout=TF_TIMEOUT), 1)


@pytest.mark.parametrize("example", ["tensorflow_digits.py", "keras_digits.py"])
def test_example_reaches_95_percent_on_2_ranks(example):
    job = run([sys.executable, "-m", "aiacc.launcher", "-np", "2", sys.executable, str(ROOT / "examples" / example)],
              timeout=TF_TIMEOUT)
    assert job.returncode == 0, job.output
    accuracies = [float(a) for a in re.findall(r"test accuracy (\d\.\d+)", job.output)]
    assert accuracies and accuracies[-1] >= 0.95, job.output


def test_train_benchmark_prints_every_mode():
    job = run([sys.executable, "-m", "aiacc.launcher", "-np", "2", sys.executable, "-m", "aiacc.bench", "train",
               "--framework", "tensorflow", "--model", "transformer", "--steps", "1", "--warmup", "1",
               "--repeats", "1", "--json"], timeout=TF_TIMEOUT)
    assert job.returncode == 0, job.output
    records = [json.loads(line) for line in job.output.splitlines() if line.startswith("{")]
    assert [r["mode"] for r in records] == ["compute", "blocking", "overlap"], job.output
    for r in records:
        assert r["ranks"] == 2 and r["samples_per_s"] > 0 and r["params"] == 525834, r
