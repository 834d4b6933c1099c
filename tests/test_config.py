"""AIACC_* variables: parsed in one place, bad values named."""

import pytest

from aiacc import config
from aiacc.exceptions import ConfigError


def test_defaults():
    cfg = config.from_env({})
    assert cfg.enable is False and cfg.fusion_threshold == 64 << 20 and cfg.stall_check_seconds == 60


def test_values_and_units():
    cfg = config.from_env({"AIACC_ENABLE": "yes", "AIACC_FUSION_THRESHOLD": "4MiB", "AIACC_CYCLE_TIME_MS": "2.5",
                           "AIACC_TIMELINE": "t.json", "AIACC_PARTITION_BYTES": "1048576"})
    assert cfg.enable and cfg.fusion_threshold == 4 << 20 and cfg.cycle_time_ms == 2.5
    assert cfg.timeline == "t.json" and cfg.partition_bytes == 1 << 20


@pytest.mark.parametrize("var,value,words", [
    ("AIACC_ENABLE", "maybe", "AIACC_ENABLE='maybe' is not valid: expected 1/0"),
    ("AIACC_FUSION_THRESHOLD", "lots", "AIACC_FUSION_THRESHOLD='lots' is not valid: expected a size in bytes"),
    ("AIACC_CYCLE_TIME_MS", "0", "AIACC_CYCLE_TIME_MS='0' is not valid: expected a number of milliseconds > 0"),
    # (accepted, they ended the engine thread with an OverflowError in a timed wait / a MemoryError at init)
    ("AIACC_CYCLE_TIME_MS", "1e300", "AIACC_CYCLE_TIME_MS='1e300' is not valid: expected a number of milliseconds > 0 "
                                     "and at most 60000"),
    ("HOROVOD_CYCLE_TIME", "1e22", "HOROVOD_CYCLE_TIME='1e22' is not valid: expected a number of milliseconds"),
    ("AIACC_CACHE_CAPACITY", "99999999999999999999", "AIACC_CACHE_CAPACITY='99999999999999999999' is not valid: "
                                                    "expected a whole number from 0 to 1048576"),
    ("AIACC_STALL_CHECK_SECONDS", "-1", "AIACC_STALL_CHECK_SECONDS='-1' is not valid"),
    ("AIACC_CACHE_CAPACITY", "1.5", "AIACC_CACHE_CAPACITY='1.5' is not valid: expected a whole number from 0"),
    ("AIACC_LOG_LEVEL", "loud", "AIACC_LOG_LEVEL='loud' is not valid: expected one of debug, info, warning, error, critical (or Horovod's trace, fatal)"),
    # (less than a byte was 0: fusion, partitions or the credit bound off without a word)
    ("AIACC_FUSION_THRESHOLD", "0.5", "AIACC_FUSION_THRESHOLD='0.5' is not valid: expected 0 or a size of at least "
                                      "one byte"),
    ("AIACC_CREDIT_BYTES", "0.0001KiB", "AIACC_CREDIT_BYTES='0.0001KiB' is not valid: expected 0 or a size"),
    # (2.5 was 2 bytes; 1e10 s overflowed the start timeout's timed wait: its watchdog thread died with a traceback;
    # a huge whole number could not be compared by the ranks' start-up shell)
    ("AIACC_FUSION_THRESHOLD", "2.5", "AIACC_FUSION_THRESHOLD='2.5' is not valid: expected a whole number of bytes"),
    ("AIACC_START_TIMEOUT", "1e10", "AIACC_START_TIMEOUT='1e10' is not valid: expected a number of seconds from 0 "
                                    "to 1e+09"),
    ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "1e23", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS='1e23' is not valid"),
    ("AIACC_HOSTS_PER_NODE", "99999999999999999999999", "expected a whole number from 0 to 2147483647"),
])
def test_bad_value_names_the_variable_and_what_it_accepts(var, value, words):
    with pytest.raises(ConfigError) as err:
        config.from_env({var: value})
    assert words in str(err.value)


def test_unknown_variable_is_an_error_not_a_silent_default():
    with pytest.raises(ConfigError, match="unknown aiacc variable AIACC_FUSION_THRESHOLD_MB"):
        config.from_env({"AIACC_FUSION_THRESHOLD_MB": "64"})


def test_every_option_has_a_flag_and_a_variable():
    flags = [o.flag for o in config.OPTIONS if o.field != "enable"]
    envs = [o.env for o in config.OPTIONS if o.field != "enable"]
    assert len(set(flags)) == len(flags) and len(set(envs)) == len(envs)
    assert all(e.startswith("AIACC_") and f.startswith("--") for e, f in zip(envs, flags))


def test_readme_documents_every_variable():
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    missing = [o.env for o in config.OPTIONS if f"`{o.env}`" not in readme]
    assert not missing, f"README's table lacks {missing}"


def test_horovods_variables_set_the_same_settings_and_aiaccs_win():
    cfg = config.from_env({"HOROVOD_FUSION_THRESHOLD": "33554432", "HOROVOD_CYCLE_TIME": "3.5",
                           "HOROVOD_CACHE_CAPACITY": "0", "HOROVOD_TIMELINE": "h.json", "HOROVOD_TIMELINE_MARK_CYCLES": "1",
                           "HOROVOD_STALL_CHECK_DISABLE": "1", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "120",
                           "HOROVOD_HIERARCHICAL_ALLREDUCE": "1", "HOROVOD_LOG_LEVEL": "TRACE",
                           "HOROVOD_AUTOTUNE": "1", "HOROVOD_AUTOTUNE_LOG": "tune.csv"})
    assert cfg.fusion_threshold == 32 << 20 and cfg.cycle_time_ms == 3.5 and cfg.cache_capacity == 0
    assert cfg.timeline == "h.json" and cfg.timeline_mark_cycles and cfg.stall_check_seconds == 0
    assert cfg.stall_shutdown_seconds == 0 and cfg.hierarchical_allreduce and cfg.log_level == "DEBUG"
    assert cfg.autotune and cfg.autotune_log == "tune.csv"
    assert config.from_env({"HOROVOD_STALL_CHECK_TIME_SECONDS": "5"}).stall_check_seconds == 5
    # disabled wins over a time (Horovod's rule, whatever the order of the variables); not disabled leaves the time
    assert config.from_env({"HOROVOD_STALL_CHECK_TIME_SECONDS": "5", "HOROVOD_STALL_CHECK_DISABLE": "1"}).stall_check_seconds == 0
    assert config.from_env({"HOROVOD_STALL_CHECK_TIME_SECONDS": "5", "HOROVOD_STALL_CHECK_DISABLE": "0"}).stall_check_seconds == 5
    assert config.from_env({"HOROVOD_STALL_CHECK_DISABLE": "0"}).stall_check_seconds == 60
    # ... and it switches the whole inspector off, the shutdown too, over any time set (Horovod's rule), aiacc's too
    off = config.from_env({"HOROVOD_STALL_CHECK_DISABLE": "yes", "AIACC_STALL_CHECK_SECONDS": "5",
                           "AIACC_STALL_SHUTDOWN_SECONDS": "9"})
    assert off.stall_check_seconds == 0 and off.stall_shutdown_seconds == 0
    assert off.variable("stall_shutdown_seconds") == "HOROVOD_STALL_CHECK_DISABLE"
    with pytest.raises(ConfigError, match="HOROVOD_STALL_CHECK_DISABLE='maybe' is not valid: expected 1/0"):
        config.from_env({"HOROVOD_STALL_CHECK_DISABLE": "maybe"})
    # messages name the variable that gave a setting: Horovod's where only that one was set
    named = config.from_env({"HOROVOD_TIMELINE": "h.json", "AIACC_CYCLE_TIME_MS": "2", "HOROVOD_CYCLE_TIME": "3"})
    assert named.variable("timeline") == "HOROVOD_TIMELINE" and named.variable("cycle_time_ms") == "AIACC_CYCLE_TIME_MS"
    assert named.variable("fusion_threshold") == "AIACC_FUSION_THRESHOLD"  # (left at its default)
    tuned = config.from_env({"HOROVOD_AUTOTUNE_WARMUP_SAMPLES": "2", "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": "7"})
    assert tuned.autotune_warmup_steps == 2 and tuned.autotune_steps_per_sample == 7
    both = config.from_env({"HOROVOD_CYCLE_TIME": "3.5", "AIACC_CYCLE_TIME_MS": "2"})
    assert both.cycle_time_ms == 2
    with pytest.raises(ConfigError, match="HOROVOD_CYCLE_TIME=.soon. is not valid: expected a number of milliseconds > 0"):
        config.from_env({"HOROVOD_CYCLE_TIME": "soon"})
    # a variable set apart from the one that decides the setting is named (init() warns with it), a bad value too
    # (both were dropped without a word); the same value is not
    assert config.from_env({"AIACC_FUSION_THRESHOLD": "0", "HOROVOD_FUSION_THRESHOLD": "abc"}).fusion_threshold == 0
    assert config.shadowed_variables({"AIACC_CYCLE_TIME_MS": "2", "HOROVOD_CYCLE_TIME": "3",
                                      "AIACC_CACHE_CAPACITY": "5", "HOROVOD_CACHE_CAPACITY": "lots",
                                      "AIACC_FUSION_THRESHOLD": "1MiB", "HOROVOD_FUSION_THRESHOLD": "1048576"}) == \
        ["HOROVOD_CYCLE_TIME=3 (not used: AIACC_CYCLE_TIME_MS=2 decides)",
         "HOROVOD_CACHE_CAPACITY=lots (not used: AIACC_CACHE_CAPACITY=5 decides; and not valid: expected a whole "
         "number from 0 to 1048576)"]


def test_a_stall_shutdown_shorter_than_the_check_is_off_as_in_horovod(caplog):
    # Horovod: "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS is less than HOROVOD_STALL_CHECK_TIME_SECONDS, will not
    # shutdown"; aiacc ended the job at the shutdown with no warning first
    cfg = config.from_env({"HOROVOD_STALL_CHECK_TIME_SECONDS": "20", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "5"})
    assert cfg.stall_check_seconds == 20 and cfg.stall_shutdown_seconds == 0
    assert "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS=5 is less than HOROVOD_STALL_CHECK_TIME_SECONDS=20: the stall " \
           "shutdown is off" in caplog.text
    # a check of an hour (Horovod's shutdown is off by default): not ended at aiacc's default 30 minutes
    assert config.from_env({"HOROVOD_STALL_CHECK_TIME_SECONDS": "3600"}).stall_shutdown_seconds == 0
    assert config.from_env({"AIACC_STALL_CHECK_SECONDS": "3600"}).stall_shutdown_seconds == 0
    # a shutdown set alone, or longer than the check, is kept
    assert config.from_env({"AIACC_STALL_SHUTDOWN_SECONDS": "3"}).stall_shutdown_seconds == 3
    assert config.from_env({"AIACC_STALL_CHECK_SECONDS": "20", "AIACC_STALL_SHUTDOWN_SECONDS": "60"}
                           ).stall_shutdown_seconds == 60
    assert config.from_env({}).stall_shutdown_seconds == 1800


def test_settings_given_explicitly_are_known_as_such():
    # (the autotuner holds those constant, as Horovod's does)
    assert config.from_env({}).explicit == frozenset()
    assert config.from_env({"HOROVOD_CYCLE_TIME": "3", "AIACC_PARTITION_BYTES": "1MiB"}).explicit == \
        {"cycle_time_ms", "partition_bytes"}


def test_horovods_variables_that_aiacc_does_not_read_are_named_at_init_with_why():
    # Horovod's run-time settings without a counterpart here (its thread affinity, oneCCL), and a misspelt one,
    # were dropped without a word; the ones aiacc reads, build-time ones (pip install) and Gloo's are not named
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith(("AIACC_", "HOROVOD_"))}
    env.update({"HOROVOD_THREAD_AFFINITY": "0", "HOROVOD_CPU_OPERATIONS": "CCL", "HOROVOD_FUSION_THRESHHOLD": "1",
                "HOROVOD_FUSION_THRESHOLD": "1MiB", "HOROVOD_WITH_PYTORCH": "1", "HOROVOD_GPU_OPERATIONS": "NCCL",
                "HOROVOD_GLOO_IFACE": "eth0"})
    out = subprocess.run([sys.executable, "-c", "import aiacc; aiacc.init(); aiacc.init(); print('done')"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "done" in out.stdout, out.stderr
    assert out.stderr.count("aiacc does not read Horovod's variables: ") == 1, out.stderr
    assert ("HOROVOD_CPU_OPERATIONS (aiacc's CPU collectives are always MPI's, with its own shared-memory "
            "reduction); HOROVOD_FUSION_THRESHHOLD (not a setting of Horovod that aiacc knows: a typo?); "
            "HOROVOD_THREAD_AFFINITY (aiacc does not pin its engine thread to cores)\n") in out.stderr, out.stderr
    for quiet in ("HOROVOD_FUSION_THRESHOLD ", "HOROVOD_WITH_PYTORCH", "HOROVOD_GPU_OPERATIONS", "HOROVOD_GLOO"):
        assert quiet not in out.stderr, out.stderr
    # a Horovod variable that another one overrides is named once, on a line of its own
    env.update({"AIACC_CACHE_CAPACITY": "8", "HOROVOD_CACHE_CAPACITY": "0"})
    out = subprocess.run([sys.executable, "-c", "import aiacc; aiacc.init(); aiacc.init(); print('done')"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "done" in out.stdout, out.stderr
    assert out.stderr.count("aiacc: HOROVOD_CACHE_CAPACITY=0 (not used: AIACC_CACHE_CAPACITY=8 decides)\n") == 1, \
        out.stderr
    # Horovod's debug/trace log level logs the settings in effect and what gave each (it logged nothing more)
    env.update({"AIACC_ENABLE": "1", "HOROVOD_LOG_LEVEL": "trace"})
    out = subprocess.run([sys.executable, "-c", "import aiacc; aiacc.init(); print('done')"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "done" in out.stdout, out.stderr
    assert "[aiacc DEBUG] aiacc started on 1 ranks; settings: enable=True (AIACC_ENABLE), fusion_threshold=1048576 " \
           "(HOROVOD_FUSION_THRESHOLD), bucket_cap=26214400 (default), " in out.stderr, out.stderr
    assert "cache_capacity=8 (AIACC_CACHE_CAPACITY)" in out.stderr and "log_level='DEBUG' (HOROVOD_LOG_LEVEL)" in \
        out.stderr, out.stderr
    assert config.unread_horovod_variables({"HOROVOD_DYNAMIC_PROCESS_SETS": "1", "HOROVOD_ELASTIC_TIMEOUT": "5",
                                            "HOROVOD_STALL_CHECK_DISABLE": "1"}) == []
