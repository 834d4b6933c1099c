"""Priorities, partitions, credit and autotuning change when bytes move, never the results."""

import csv

import pytest

from conftest import aiaccrun, assert_ok


@pytest.mark.parametrize("env", [
    {},
    {"AIACC_PARTITION_BYTES": "64KiB"},
    {"AIACC_PARTITION_BYTES": "64KiB", "AIACC_CREDIT_BYTES": "100KiB", "AIACC_FUSION_THRESHOLD": "256KiB"},
    {"AIACC_PRIORITY": "0", "AIACC_FUSION_THRESHOLD": "0"},
], ids=["default", "partitions", "partitions+credit", "fifo-unfused"])
def test_scheduled_results_equal_the_reference(env):
    job = aiaccrun(2, "scheduling.py", env=env)
    assert_ok(job, 2)


def test_scheduling_with_three_ranks():
    job = aiaccrun(3, "scheduling.py", env={"AIACC_PARTITION_BYTES": "100KiB", "AIACC_CREDIT_BYTES": "200KiB"})
    assert_ok(job, 3)


@pytest.mark.parametrize("warmup", ["1", "0"])
def test_autotune_settles_logs_and_every_rank_applies_the_same_choice(tmp_path, warmup):
    log = tmp_path / "new-folder" / "autotune.csv"  # (its folder made, as the timeline's; it was an error)
    env = {"AIACC_AUTOTUNE": "1", "AIACC_AUTOTUNE_WARMUP_STEPS": warmup, "AIACC_AUTOTUNE_STEPS_PER_SAMPLE": "2",
           "AIACC_AUTOTUNE_LOG": str(log), "AIACC_LOG_LEVEL": "info"}
    # 11 samples x (1 + 2) steps = 33 steps to settle; run 40
    job = aiaccrun(2, "scheduling.py", "40", env=env)
    assert_ok(job, 2)
    assert job.output.count("autotune_done=True") == 2, job.output
    rows = list(csv.DictReader(log.open()))
    trials = [row for row in rows if row["knob"] != "chosen"]
    assert [row["knob"] for row in trials] == ["fusion_threshold"] * 4 + ["cycle_time_ms"] * 4 + ["partition_bytes"] * 3
    # each sample timed its own steps (with no warmup steps, every sample read the time since boot: ~1e3 s)
    assert all(0 < float(row["seconds"]) < job.seconds for row in trials), (job.seconds, rows)
    chosen = [row for row in rows if row["knob"] == "chosen"]
    assert len(chosen) == 1
    best = max(trials, key=lambda row: float(row["steps_per_second"]))
    c = chosen[0]
    assert float(c["steps_per_second"]) == pytest.approx(float(best["steps_per_second"]))
    # the settings every rank reported are the chosen ones
    want = f"settings=({c['fusion_threshold']}, {float(c['cycle_time_ms'])}, {c['partition_bytes']}, 0)"
    assert job.output.count(want) == 2, (want, job.output)
    assert job.output.count("aiacc autotune chose ") == 1, job.output  # (rank 0 says it, once)


def test_autotune_holds_the_settings_the_user_gave_as_horovod_does(tmp_path):
    """HOROVOD_FUSION_THRESHOLD / the cycle time set: only the partition size is tried, and the job ends with
    the values given (the tuner replaced them with its own candidates)."""
    log = tmp_path / "autotune.csv"
    env = {"AIACC_AUTOTUNE": "1", "AIACC_AUTOTUNE_WARMUP_STEPS": "0", "AIACC_AUTOTUNE_STEPS_PER_SAMPLE": "2",
           "AIACC_AUTOTUNE_LOG": str(log), "HOROVOD_FUSION_THRESHOLD": str(32 << 20), "AIACC_CYCLE_TIME_MS": "3"}
    job = aiaccrun(2, "scheduling.py", "12", env=env)
    assert_ok(job, 2)
    assert job.output.count("autotune_done=True") == 2, job.output
    rows = list(csv.DictReader(log.open()))
    assert [row["knob"] for row in rows] == ["partition_bytes"] * 3 + ["chosen"], rows
    assert all(row["fusion_threshold"] == str(32 << 20) and float(row["cycle_time_ms"]) == 3.0 for row in rows), rows
    want = f"settings=({32 << 20}, 3.0, {rows[-1]['partition_bytes']}, 0)"
    assert job.output.count(want) == 2, (want, job.output)


def test_autotune_holds_a_setting_given_to_one_rank_only_on_every_rank(tmp_path):
    """The cycle time set on rank 1 only (to its default; it may differ per rank): each rank's autotuner
    tuned the knobs its own rank was not given, so they applied different partitions and waited for each
    other for ever. Now every rank holds it constant and tries the partition size only."""
    log = tmp_path / "autotune.csv"
    env = {"AIACC_AUTOTUNE": "1", "AIACC_AUTOTUNE_WARMUP_STEPS": "0", "AIACC_AUTOTUNE_STEPS_PER_SAMPLE": "2",
           "AIACC_AUTOTUNE_LOG": str(log), "HOROVOD_FUSION_THRESHOLD": str(32 << 20)}
    job = aiaccrun(2, "scheduling.py", "12", "AIACC_CYCLE_TIME_MS=1@1", env=env)
    assert_ok(job, 2)
    assert job.output.count("autotune_done=True") == 2, job.output
    rows = list(csv.DictReader(log.open()))
    assert [row["knob"] for row in rows] == ["partition_bytes"] * 3 + ["chosen"], rows
