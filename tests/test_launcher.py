"""aiaccrun: the right mpiexec, flags into variables, worst exit status, clear errors."""

import os
import re
import stat
import subprocess
import sys

import pytest

from aiacc.config import launched_as
from aiacc.launcher import LauncherError, build_command, find_mpiexec, parse_hosts
from conftest import WORKERS, aiaccrun, assert_ok, base_env, need_framework, run


def aiaccrun_cli(*args, env=None):
    return run([sys.executable, "-m", "aiacc.launcher", *args], env=env, timeout=60)


def test_help_documents_flags_hosts_and_variables():
    job = aiaccrun_cli("--help")
    assert job.returncode == 0
    for word in ("-np N", "--hostfile", "-H", "--fusion-threshold-mb", "AIACC_FUSION_THRESHOLD", "--cycle-time-ms",
                 "AIACC_CYCLE_TIME_MS", "--timeline", "--stall-check-seconds", "AIACC_STALL_SHUTDOWN_SECONDS", "srun",
                 "worst exit status", "--host-discovery-script", "--min-np", "--max-np", "--elastic-timeout"):
        assert word in job.output, word


def test_flags_become_variables_on_every_rank():
    job = aiaccrun(2, "exit_code.py", "0,0", flags=["--cycle-time-ms", "3", "--fusion-threshold-mb", "2"])
    assert job.returncode == 0, job.output
    for r in range(2):
        assert f"OK rank={r} cycle_time_ms=3.0 fusion=2097152 size=2" in job.output, job.output


def test_aiacc_variables_of_the_caller_are_forwarded():
    job = aiaccrun(2, "exit_code.py", "0,0", env={"AIACC_CYCLE_TIME_MS": "4"})
    assert job.output.count("cycle_time_ms=4.0") == 2, job.output


@pytest.mark.parametrize("codes,expected", [("0,3", 3), ("5,0,2", 5), ("0,0,0", 0)])
def test_exit_status_is_the_worst_of_the_ranks(codes, expected):
    job = aiaccrun(len(codes.split(",")), "exit_code.py", codes)
    assert job.returncode == expected, job.output


@pytest.mark.parametrize("ranks", [2, 3])
def test_a_rank_that_exits_while_others_wait_for_it_keeps_its_exit_status(ranks):
    """Rank 1 calls sys.exit(3) while the others wait for it in an allreduce: they get a ShutdownError naming
    rank 1, and since every engine has stopped they exit without aborting the job, so aiaccrun reports rank 1's
    3 (their MPI_Abort used to kill rank 1 before it had exited: the job ended with 1)."""
    job = aiaccrun(ranks, "exit_early.py", "3")
    assert job.returncode == 3, job.output
    for r in range(ranks):
        if r != 1:
            assert f"on rank {r} did not complete: aiacc was shut down by rank 1" in job.output or \
                "cannot submit allreduce of tensor 'x': aiacc was shut down by rank 1" in job.output, job.output
    assert job.output.count("every rank's engine has stopped, the job is not aborted") == ranks - 1, job.output
    assert "MPI_Abort" not in job.output, job.output


def test_ddp_on_the_aiacc_backend_reads_the_error_of_a_rank_that_exits():
    """The same under DDP (backend "aiacc"): its reducer reads the ShutdownError from the allreduce's future. The
    future used to complete *successfully* with the exception as its value (torch's Python set_exception): the
    reducer took it for its tensors and rank 0 died of a segmentation fault (exit 139, rank 1 never named)."""
    job = aiaccrun(2, "ddp_exit_early.py", "3", timeout=180)
    assert job.returncode == 3, job.output
    assert "on rank 0 did not complete: aiacc was shut down by rank 1" in job.output, job.output
    assert "every rank's engine has stopped, the job is not aborted" in job.output, job.output
    assert "Segmentation fault" not in job.output and "MPI_Abort" not in job.output, job.output


def test_an_uncaught_exception_under_the_aiacc_backend_prints_its_traceback():
    """An exception nobody catches on rank 1 of a DDP script (backend "aiacc") aborts the job with its traceback.
    torch's init_process_group wraps the excepthook, sending what aiacc's printed into a buffer written out after it
    returned, which the abort never did: the job ended with MPI's "Abort(1) on node 1" alone."""
    job = aiaccrun(2, "ddp_exit_early.py", "raise", timeout=180)
    assert job.returncode != 0, job.output
    assert "ValueError: rank 1: batch 3 of data.csv is corrupt" in job.output, job.output
    assert 'ddp_exit_early.py", line' in job.output, job.output  # the traceback
    assert "aiacc: unhandled ValueError on rank 1; aborting all 2 ranks" in job.output, job.output


@pytest.mark.parametrize("given", ["flag", "HOROVOD_START_TIMEOUT"])
def test_a_rank_that_exits_before_init_ends_the_job_after_the_start_timeout(given):
    """MPICH's launcher does not notice a rank that exits before it starts MPI: the others waited in MPI's
    start-up forever (horovodrun's --start-timeout was ignored). Now the waiting rank ends the job after
    --start-timeout seconds, saying why, and aiaccrun names how each rank ended. The message names what set the
    limit: Horovod's variable where the job set that (it named AIACC_START_TIMEOUT)."""
    flags, env = (["--start-timeout", "3"], None) if given == "flag" else ([], {given: "3"})
    job = aiaccrun_cli("-np", "2", *flags, sys.executable, str(WORKERS / "dies.py"), "before-init", env=env)
    assert job.returncode == 1, job.output
    assert "rank 1: cannot read data.csv" in job.output, job.output
    assert "aiacc: rank 0 has waited 3 s in MPI's start-up for the other ranks of the job: a rank exited (or " \
           "hangs) before aiacc.init()" in job.output, job.output
    named = "AIACC_START_TIMEOUT" if given == "flag" else given
    assert f"({named} / aiaccrun --start-timeout sets this limit" in job.output, job.output
    assert "aiaccrun: the job failed: rank 0 exited with status 1, rank 1 exited with status 1" in job.output, \
        job.output


@pytest.mark.parametrize("how,ended", [("kill", "rank 1 was killed by signal 9"), ("os-exit", "rank 1 exited with status 5")])
def test_aiaccrun_names_the_rank_that_died(how, ended):
    """A rank killed by a signal or ended by os._exit: MPI's banner gives a process id (or nothing), aiaccrun
    names the rank (MPI then kills rank 0, which hydra records as killed by signal 9 now and then: listed too)."""
    job = aiaccrun(2, "dies.py", how)
    assert job.returncode in ((137,) if how == "kill" else (5, 137)), job.output  # (the worst: rank 0's 9 too)
    failed = [line for line in job.output.splitlines() if line.startswith("aiaccrun: the job failed: ")]
    assert len(failed) == 1 and ended in failed[0], job.output


def test_a_rank_ended_by_mpiexec_after_another_left_with_status_0_fails_the_job(tmp_path):
    """Rank 1 calls os._exit(0) in the middle of training: hydra kills rank 0 and lists both statuses as 0, so the
    job passed for a success with rank 0's training unfinished. The ranks say how they ended (aiacc.exits)."""
    job = aiaccrun(2, "dies.py", "os-exit-0")
    assert job.returncode == 1, job.output
    assert "aiaccrun: the job failed: rank 0 did not finish: mpiexec ended it after rank 1 called os._exit(0)" \
        in job.output, job.output
    from aiacc import exits
    for name, text in (("rank0.started", ""), ("rank1.started", ""), ("rank0.ended", "os._exit(0)"),
                       ("rank1.ended", "exit")):
        (tmp_path / name).write_text(text)
    assert exits.unfinished(str(tmp_path)) is None  # (ending by os._exit is ending: the rank was not killed)
    (tmp_path / "rank2.started").write_text("")
    (tmp_path / "rank3.started").write_text("")
    report = exits.unfinished(str(tmp_path))
    assert report.killed == [2, 3] and report.left == {0: "os._exit(0)"}, report
    assert report.report.startswith("ranks 2, 3 did not finish: mpiexec ended them after rank 0 called os._exit(0) "
                                    "while the others ran")
    # hydra reports the ranks it ended with status 0, or now and then as killed by SIGKILL (raw wait status 9): the
    # job's outcome is the same (seen in CI: 'rank 0 was killed by signal 9', exit 137)
    from aiacc.launcher import job_outcome
    for statuses, code in (([0, 0, 0, 0], 0), ([0, 0, 9, 0], 137), ([0, 0, 9, 9], 137)):
        assert job_outcome(code, statuses, report, False) == (1, report.report), statuses
    assert job_outcome(5, [0, 5 << 8], report, False) == (5, "rank 1 exited with status 5")  # a status of its own
    assert job_outcome(137, [9, 0], None, False) == (137, "rank 0 was killed by signal 9")  # no rank left by os._exit
    killed_only = exits.Unfinished([1], {})  # (a rank killed, none left by os._exit: the signal is the failure)
    assert job_outcome(137, [0, 9], killed_only, False) == (137, "rank 1 was killed by signal 9")
    assert job_outcome(0, [0, 0], killed_only, False) == (1, killed_only.report)


def test_a_rank_that_leaves_by_os_exit_on_another_host_ends_the_job_not_the_stall_shutdown():
    """Two hosts (loopback names): hydra ends only the leaving rank's host, and the other host's rank waited for
    it until the stall shutdown (30 minutes). aiaccrun ends the job a few seconds after a rank left while others
    still run, and names the rank that left."""
    job = aiaccrun(2, "dies.py", "os-exit-0", flags=["-H", "localhost:1,127.0.0.1:1"], timeout=150)
    assert job.returncode == 1, job.output
    assert "aiaccrun: rank 1 called os._exit(0) 5 s ago and rank 0 still runs" in job.output, job.output
    assert "aiaccrun: the job failed: rank 0 did not finish: mpiexec ended it after rank 1 called os._exit(0)" \
        in job.output, job.output


def test_a_rank_killed_on_another_host_is_not_blamed_on_another_rank_and_leaves_no_shared_memory():
    """Two hosts: hydra lists the exit codes of the hosts whose proxy lived only, so a partial list was read in
    rank order ("rank 0 was killed by signal 9" for rank 1), or none ("exit status 255"). A partial list is not
    used: the ranks that did not end by themselves are named. MPICH's shared-memory segments that the killed
    ranks left in /dev/shm are removed once no process maps them."""
    from aiacc import exits
    before = exits.mpich_segments()
    job = aiaccrun(2, "dies.py", "kill", flags=["-H", "localhost:1,127.0.0.1:1"], timeout=150)
    failed = [line for line in job.output.splitlines() if line.startswith("aiaccrun: the job failed: ")]
    assert job.returncode != 0 and len(failed) == 1, job.output
    assert "rank 1 was killed by signal 9" in failed[0] or "ranks 0, 1 did not end by themselves" in failed[0], \
        job.output
    assert "rank 0 was killed" not in failed[0] or "rank 1 was killed" in failed[0], job.output
    assert exits.remove_orphaned_segments(before) == [], "aiaccrun left MPICH segments behind"


def test_ctrl_c_typed_in_a_terminal_reaches_the_scripts_own_keyboardinterrupt_handler():
    """aiaccrun in a terminal (a pseudo-terminal here) and one Ctrl-C typed there: the terminal sends SIGINT to
    aiaccrun and to mpiexec, its child in the same process group. aiaccrun passed its SIGINT on as well, hydra took
    the two for a double Ctrl-C and forced an abort (status 255, "assert (!closed) failed"): the scripts' `except
    KeyboardInterrupt` (say, saving a checkpoint) never ran, where under a bare mpiexec it does."""
    import pty  # noqa: PLC0415
    import select  # noqa: PLC0415
    import signal  # noqa: PLC0415
    import time  # noqa: PLC0415

    code = ("import os, time, aiacc; aiacc.init()\n"
            "try:\n    os.write(1, b'STARTED\\n')\n    time.sleep(120)\nexcept KeyboardInterrupt:\n"
            "    time.sleep(1)\n"  # (writing the checkpoint)
            "    os.write(1, f'SAVED rank={aiacc.rank()}\\n'.encode())\n")
    pid, fd = pty.fork()
    if pid == 0:  # (a new session whose controlling terminal is the pty: aiaccrun is its foreground group)
        os.execvpe(sys.executable, [sys.executable, "-m", "aiacc.launcher", "-np", "2", sys.executable, "-c", code],
                   base_env())
    out, typed, hung, deadline = b"", False, False, time.monotonic() + 90
    try:
        while time.monotonic() < deadline:
            if select.select([fd], [], [], 0.5)[0]:
                try:
                    chunk = os.read(fd, 4096)
                except OSError:  # (EIO: every process on the terminal has ended)
                    break
                if not chunk:
                    break
                out += chunk
            if not typed and out.count(b"STARTED") == 2:
                os.write(fd, b"\x03")  # Ctrl-C, typed
                typed = True
        else:
            hung = True
    finally:
        if hung or sys.exc_info()[0] is not None:
            os.killpg(pid, signal.SIGKILL)
        os.close(fd)
        _, status = os.waitpid(pid, 0)
    text = out.decode(errors="replace")
    assert not hung, f"the job did not end within 90 s (hang):\n{text}"
    assert typed, text
    assert "SAVED rank=0" in text and "SAVED rank=1" in text, text
    assert os.waitstatus_to_exitcode(status) == 0 and "assert (!closed)" not in text, text


def test_sigint_to_aiacc_runs_process_group_reaches_each_scripts_keyboardinterrupt_handler_once():
    """SIGINT sent to aiaccrun's process group (`kill -INT -- -PGID`, GNU timeout's, a batch system's), no terminal:
    mpiexec, in aiaccrun's group, got it directly and again from aiaccrun; hydra took the two for a double Ctrl-C and
    forced an abort: the scripts' `except KeyboardInterrupt` did not run (or on one rank), and the job ended with
    status 0 in 1 run of 3, else 255. Now each rank's handler runs, and the job's status is the scripts' own."""
    import signal  # noqa: PLC0415
    import time  # noqa: PLC0415

    code = ("import os, sys, time, aiacc; aiacc.init()\n"
            "try:\n    os.write(1, b'STARTED\\n')\n    time.sleep(120)\nexcept KeyboardInterrupt:\n"
            "    os.write(1, f'SAVED rank={aiacc.rank()}\\n'.encode())\n    sys.exit(7)\n")
    proc = subprocess.Popen([sys.executable, "-m", "aiacc.launcher", "-np", "2", sys.executable, "-c", code],
                            env=base_env(), start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    out = b""
    try:
        deadline = time.monotonic() + 90
        while out.count(b"STARTED") < 2:
            assert time.monotonic() < deadline, out.decode(errors="replace")
            chunk = os.read(proc.stdout.fileno(), 4096)
            assert chunk, out.decode(errors="replace")
            out += chunk
        os.killpg(proc.pid, signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
        out += rest
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = out.decode(errors="replace")
    assert "SAVED rank=0" in text and "SAVED rank=1" in text, text
    assert proc.returncode == 7 and "Ctrl-C caught" not in text, (proc.returncode, text)


def test_stdin_goes_to_rank_0_and_the_other_ranks_read_end_of_file():
    """A script reading stdin on every rank (its config, `aiaccrun python < script.py`): rank 0 read it, the others
    waited for ever on a pipe hydra never closed. Now they read end-of-file, as under horovodrun (Open MPI)."""
    code = ("import os, sys, aiacc; aiacc.init(); "
            "os.write(1, f'rank {aiacc.rank()} read {len(sys.stdin.read())} bytes\\n'.encode())")
    job = subprocess.run([sys.executable, "-m", "aiacc.launcher", "-np", "2", sys.executable, "-c", code],
                         env=base_env(), input='{"lr": 0.1}', capture_output=True, text=True, timeout=90)
    assert job.returncode == 0, job.stdout + job.stderr
    assert "rank 0 read 11 bytes" in job.stdout and "rank 1 read 0 bytes" in job.stdout, job.stdout + job.stderr


def test_open_mpi_options_in_mpi_args_are_named_with_mpichs_form():
    """horovodrun users pass Open MPI's `-x VAR` (and `--mca`): hydra answered with a parser trace ("match_arg ...:
    unrecognized argument x", exit 255)."""
    job = aiaccrun_cli("-np", "2", "--mpi-args=-x FOO=1", sys.executable, "-c", "pass")
    assert job.returncode == 2, job.output
    assert "--mpi-args -x FOO=1 is Open MPI's" in job.output and "-genv FOO 1" in job.output, job.output
    job = aiaccrun_cli("-np", "2", "--mpi-args", "--mca btl tcp", sys.executable, "-c", "pass")
    assert job.returncode == 2 and "--mca is Open MPI's" in job.output, job.output


def test_a_flag_that_does_nothing_in_the_run_is_named_in_a_warning():
    """The autotuner's flags without --autotune, --elastic-timeout without --host-discovery-script: taken without a
    word (a log file never written)."""
    job = aiaccrun_cli("-np", "2", "--autotune-log-file", "at.csv", "--elastic-timeout", "10", sys.executable, "-c",
                       "import os, aiacc; aiacc.init(); os.write(1, f'RAN {aiacc.rank()}\\n'.encode())")
    assert job.returncode == 0 and "RAN 1" in job.output, job.output
    assert "--autotune-log-file applies only with --autotune" in job.output, job.output
    assert "--elastic-timeout applies only with --host-discovery-script" in job.output, job.output
    job = aiaccrun_cli("-np", "2", "--autotune", "--autotune-log-file", os.devnull, sys.executable, "-c", "pass")
    assert "applies only" not in job.output, job.output


def test_bad_flag_value_is_refused_before_anything_starts():
    job = aiaccrun_cli("-np", "2", "--cycle-time-ms", "soon", "python", "-c", "pass")
    assert job.returncode == 2
    assert "--cycle-time-ms 'soon' is not valid: expected a number of milliseconds > 0" in job.output


def test_a_value_after_a_switch_that_takes_none_is_refused_not_run_as_the_command():
    """``--autotune 1 python train.py`` ran "1" as every rank's program (status 127, "exec: 1: not found")."""
    job = aiaccrun_cli("-np", "2", "--autotune", "1", "python", "-c", "pass")
    assert job.returncode == 2, job.output
    assert "--autotune takes no value (it sets AIACC_AUTOTUNE=1; for 0 leave it out or give --no-autotune): '1' " \
           "would be the command" in job.output
    job = aiaccrun_cli("-np", "2", "--summary", "off", "python", "-c", "pass")
    assert job.returncode == 2 and "--summary takes no value (it sets AIACC_SUMMARY=1; for 0 leave it out)" \
        in job.output, job.output
    # --dynamic-process-sets takes one (it could only set the default, 1): 0 gives Horovod's static sets
    job = aiaccrun_cli("-np", "2", "--dynamic-process-sets", "0", "--print-command", "python", "train.py")
    assert job.returncode == 0 and "-genv AIACC_DYNAMIC_PROCESS_SETS 0" in job.output, job.output


@pytest.mark.parametrize("flag,value,accepts", [
    ("--fusion-threshold-mb", "abc", "a number of MiB >= 0"), ("--fusion-threshold-mb", "nan", "a number of MiB >= 0"),
    ("--fusion-threshold-mb", "1e400", "a number of MiB >= 0"), ("--fusion-threshold-mb", "-1", "a number of MiB >= 0"),
    ("--bucket-cap-mb", "inf", "a number of MiB > 0"), ("--bucket-cap-mb", "-1", "a number of MiB > 0"),
    # (less than a byte was 0 bytes: fusion off, without a word)
    ("--fusion-threshold-mb", "1e-7", "0 or a number of MiB of at least one byte")])
def test_bad_size_in_mib_is_refused_naming_the_flag(flag, value, accepts):
    """The MiB flags convert before they are checked: a value that is no finite number was a traceback from
    float() or int() (``could not convert string to float``, ``OverflowError``) naming neither flag nor value;
    the message speaks of MiB, the flag's unit (it said 'a size in bytes such as 67108864')."""
    job = aiaccrun_cli("-np", "2", flag, value, "python", "-c", "pass")
    assert job.returncode == 2, job.output
    assert f"aiaccrun: error: {flag} {value!r} is not valid: expected {accepts}" in job.output, \
        job.output
    assert "Traceback" not in job.output, job.output


@pytest.mark.parametrize("flag", ["--autotune-warmup-samples", "--min-num-proc"])
def test_a_bad_value_of_horovodruns_flag_is_named_by_that_flag(flag):
    job = aiaccrun_cli("-np", "2", flag, "-2", "python", "-c", "pass")
    assert job.returncode == 2, job.output
    assert f"aiaccrun: error: {flag} '-2' is not valid" in job.output, job.output


def test_bad_forwarded_variable_is_refused():
    job = aiaccrun_cli("-np", "2", "python", "-c", "pass", env={"AIACC_FUSION_THRESHOLD": "huge"})
    assert job.returncode == 2
    assert "AIACC_FUSION_THRESHOLD='huge' is not valid" in job.output


@pytest.mark.parametrize("value,words", [
    ("0", "AIACC_ENABLE='0' switches aiacc off, and aiaccrun runs it on every rank: unset AIACC_ENABLE (or set it "
          "to 1), or run the script without aiaccrun"),
    ("maybe", "AIACC_ENABLE='maybe' is not valid: expected 1/0, true/false, yes/no or on/off"),
])
def test_aiacc_switched_off_or_a_bad_switch_under_aiaccrun_is_refused_not_replaced_by_on(value, words):
    # (aiaccrun set AIACC_ENABLE=1 over it without a word: the ranks ran the engine at size 2, exit 0)
    job = aiaccrun_cli("-np", "2", sys.executable, "-c", "print('RAN')", env={"AIACC_ENABLE": value})
    assert job.returncode == 2 and f"aiaccrun: error: {words}" in job.output and "RAN" not in job.output, job.output
    job = aiaccrun_cli("-np", "2", sys.executable, "-c", "import aiacc; aiacc.init(); print(f'SIZE={aiacc.size()}')",
                       env={"AIACC_ENABLE": " on"})
    assert job.returncode == 0 and job.output.count("SIZE=2") == 2, job.output


@pytest.mark.parametrize("variable,value,flag", [("HOROVOD_CYCLE_TIME", "-1", "--cycle-time-ms"),
                                                 ("HOROVOD_STALL_CHECK_DISABLE", "maybe", "--no-stall-check")])
def test_a_bad_horovod_variable_is_refused_before_anything_starts_unless_a_flag_sets_it(variable, value, flag):
    """Horovod's names reach the ranks with the caller's environment: a bad value started every rank, each of
    which died at init() with a traceback (a script without aiacc ran on). It is refused as AIACC_* ones are;
    a flag for the same setting decides instead, on the ranks too, and the job runs."""
    code = "print('RAN-IT')"
    job = aiaccrun_cli("-np", "2", sys.executable, "-c", code, env={variable: value})
    assert job.returncode == 2, job.output
    assert f"aiaccrun: error: {variable}={value!r} is not valid" in job.output, job.output
    assert "RAN-IT" not in job.output and "Traceback" not in job.output, job.output
    job = aiaccrun_cli("-np", "2", *([flag, "3"] if flag == "--cycle-time-ms" else [flag]), sys.executable, "-c",
                       "import aiacc; aiacc.init(); " + code, env={variable: value})
    assert job.returncode == 0 and job.output.count("RAN-IT") == 2, job.output


def _fake_launcher(tmp_path, banner):
    path = tmp_path / "mpiexec"
    path.write_text(f"#!/bin/sh\necho '{banner}'\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_an_mpiexec_of_another_mpi_is_refused(tmp_path):
    fake = _fake_launcher(tmp_path, "mpiexec (Open MPI) 4.1.4")
    job = aiaccrun_cli("-np", "2", "python", "-c", "pass", env={"AIACC_MPIEXEC": fake})
    assert job.returncode == 2
    assert "is a openmpi launcher but mpi4py uses MPICH" in job.output, job.output


def test_no_usable_mpiexec_is_a_clear_error(tmp_path):
    _fake_launcher(tmp_path, "mpiexec (Open MPI) 4.1.4")
    with pytest.raises(LauncherError) as err:
        find_mpiexec(search_dirs=[str(tmp_path)])
    text = str(err.value)
    assert "no mpiexec for MPICH" in text and "(the MPI that mpi4py uses)" in text
    assert f"{tmp_path}/mpiexec (openmpi)" in text and "pip install mpich" in text


def test_matching_mpiexec_is_found_even_when_another_is_first_on_path(tmp_path):
    _fake_launcher(tmp_path, "mpiexec (Open MPI) 4.1.4")
    env = {"PATH": f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}"}
    job = aiaccrun(2, "exit_code.py", "0,0", env=env)
    assert job.returncode == 0, job.output


def test_hosts_and_hostfile_formats(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# cluster\nnode1 slots=4\nnode2:2\nnode3\n")
    assert parse_hosts(None, str(hostfile)) == [("node1", 4), ("node2", 2), ("node3", 1)]
    assert parse_hosts("a:2,b:3", None) == [("a", 2), ("b", 3)]
    # Horovod's readings: a tab, spaces around '=', other keys beside slots (Open MPI's max_slots)
    hostfile.write_text("node1\tslots=2\nnode2 slots = 3\nnode3 max_slots=8 slots=1\n")
    assert parse_hosts(None, str(hostfile)) == [("node1", 2), ("node2", 3), ("node3", 1)]
    hostfile.write_text("node1 max_slots=8\n")
    with pytest.raises(LauncherError, match="host entry 'node1 max_slots=8': expected `host slots=N`"):
        parse_hosts(None, str(hostfile))
    with pytest.raises(LauncherError, match="slots must be a whole number"):
        parse_hosts("a:x", None)
    with pytest.raises(LauncherError, match="cannot read hostfile"):
        parse_hosts(None, str(tmp_path / "missing"))


def test_a_hostfile_or_hosts_naming_no_host_are_refused_not_run_on_this_machine(tmp_path):
    """A hostfile of comments and blank lines only (or -H '' / -H ',') was taken for no hosts at all: the job meant
    for the cluster started here, on -np ranks, without a word (horovodrun refuses it)."""
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# node1 slots=4\n\n   \n")
    job = aiaccrun_cli("-np", "2", "--hostfile", str(hostfile), sys.executable, "-c", "print('RAN-IT')")
    assert job.returncode == 2, job.output
    assert f"aiaccrun: error: hostfile {str(hostfile)!r} has only blank lines and comments: it names no hosts" \
        in job.output and "RAN-IT" not in job.output, job.output
    for hosts in ("", ","):
        job = aiaccrun_cli("-np", "2", "-H", hosts, sys.executable, "-c", "print('RAN-IT')")
        assert job.returncode == 2 and f"-H {hosts!r} is empty: it names no hosts" in job.output, job.output
        assert "RAN-IT" not in job.output, job.output
    with pytest.raises(LauncherError, match="host entry ':2': no host name"):
        parse_hosts(":2", None)


def test_more_ranks_than_the_hosts_slots_are_refused_before_anything_starts(tmp_path):
    """As horovodrun does (hydra would place the extra ranks on the hosts again, round-robin)."""
    job = aiaccrun_cli("-np", "3", "-H", "localhost:2", "python", "-c", "pass")
    assert job.returncode == 2 and "-np 3 is more than the 2 slots of localhost:2" in job.output, job.output
    hostfile = tmp_path / "hosts"
    hostfile.write_text("n1 slots=2\nn2\n")
    job = aiaccrun_cli("-np", "4", "--hostfile", str(hostfile), "--print-command", "python", "t.py")
    assert job.returncode == 2 and "-np 4 is more than the 3 slots of" in job.output, job.output


def test_command_line_for_each_mpi_family():
    hydra = build_command("/x/mpiexec", "mpich", 4, [("a", 2), ("b", 2)], {"AIACC_ENABLE": "1"}, ["python", "t.py"])
    assert hydra == ["/x/mpiexec", "-n", "4", "-print-all-exitcodes", "-hosts", "a:2,b:2", "-genv", "AIACC_ENABLE", "1", "python", "t.py"]
    ompi = build_command("/y/mpiexec", "openmpi", 4, [("a", 2), ("b", 2)], {"AIACC_ENABLE": "1"}, ["python", "t.py"])
    assert ompi == ["/y/mpiexec", "-n", "4", "-H", "a:2,b:2", "-x", "AIACC_ENABLE=1", "python", "t.py"]


def test_print_command_shows_hosts_and_variables(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("n1 slots=2\nn2 slots=2\n")
    job = aiaccrun_cli("-np", "4", "--hostfile", str(hostfile), "--timeline", "t.json", "--print-command",
                       "python", "train.py")
    assert job.returncode == 0, job.output
    assert "-hosts n1:2,n2:2" in job.output and "-genv AIACC_TIMELINE t.json" in job.output
    assert "-genv AIACC_ENABLE 1" in job.output and job.output.strip().endswith("python train.py")


def test_horovodruns_flags_mean_the_same_or_are_named_as_ignored_or_refused(tmp_path):
    """A Horovod job's command line with `horovodrun` replaced by `aiaccrun`: Horovod's names for aiacc's settings
    set the same variables, its off-switches set 0, flags without meaning for aiacc are named as ignored, and
    flags that would change how ranks start are refused with what to do instead."""
    hostfile = tmp_path / "hosts"
    hostfile.write_text("n1 slots=2\nn2 slots=2\n")
    job = aiaccrun_cli("--num-proc", "4", "-hostfile", str(hostfile), "--timeline-filename", "t.json",
                       "--autotune-log-file", "a.csv", "--stall-check-warning-time-seconds", "30",
                       "--stall-check-shutdown-time-seconds", "90", "--no-hierarchical-allreduce", "--log-level", "TRACE",
                       "--gloo", "--verbose", "--start-timeout", "30", "--mpi-args=-verbose", "--network-interface", "eth1",
                       "--print-command", "python", "train.py")
    assert job.returncode == 0, job.output
    for part in ("-n 4", "-hosts n1:2,n2:2", "-genv AIACC_TIMELINE t.json", "-genv AIACC_AUTOTUNE_LOG a.csv",
                 "-genv AIACC_STALL_CHECK_SECONDS 30", "-genv AIACC_STALL_SHUTDOWN_SECONDS 90",
                 "-genv AIACC_HIERARCHICAL_ALLREDUCE 0", "-genv AIACC_LOG_LEVEL TRACE", "-genv AIACC_START_TIMEOUT 30",
                 "-verbose -iface eth1"):
        assert part in job.output, (part, job.output)
    assert "ignoring horovodrun's --gloo, --verbose: no meaning for aiacc (--gloo: aiacc's controller" in job.output, job.output
    assert "--verbose: horovodrun's own output; aiacc's log level is --log-level)" in job.output, job.output
    for flags, words in ((["-p", "2222"], "--ssh-port is not taken: put the port in ~/.ssh/config"),
                         (["--config-file", "c.yaml"], "--config-file is not taken"),
                         (["--reset-limit", "3"], "--max-restarts N with --elastic-dir DIR"),
                         (["--jsrun"], "--jsrun is not taken"),  # (a switch: "python" is the command)
                         (["--no-autotune", "--autotune"], "--autotune and --no-autotune contradict each other"),
                         (["--network-interface", "eth0,eth1"], "MPICH's mpiexec takes one interface"),
                         # (hydra's own four-line error and status 255 before)
                         (["--network-interface", "nosuch0"], "'nosuch0': no such interface on this host (it has lo")):
        job = aiaccrun_cli("-np", "2", *flags, "python", "train.py")
        assert job.returncode == 2 and words in job.output, (flags, job.output)
    # horovodrun's two-valued --blacklist-cooldown-range (ignored: the command is still python), its stall
    # switches (Horovod's own variable, which turns the whole inspector off over any time), --mpi-args' quotes
    job = aiaccrun_cli("-np", "2", "--blacklist-cooldown-range", "10", "100", "--no-stall-check",
                       "--stall-check-warning-time-seconds", "5", "--mpi-args", "-genv FOO 'a b'", "--print-command",
                       "python", "train.py")
    assert job.returncode == 0 and "ignoring horovodrun's --blacklist-cooldown-range" in job.output, job.output
    assert "-genv HOROVOD_STALL_CHECK_DISABLE 1" in job.output and "-genv FOO 'a b' " in job.output, job.output
    assert job.output.strip().endswith("aiaccrun-rank python train.py"), job.output
    job = aiaccrun_cli("-np", "2", "--stall-check", "--print-command", "python", "train.py")
    assert job.returncode == 0 and "-genv HOROVOD_STALL_CHECK_DISABLE 0" in job.output, job.output
    for flags, words in ((["--stall-check", "--no-stall-check"], "--stall-check and --no-stall-check contradict"),
                         (["--gloo", "--mpi"], "--gloo and --mpi contradict each other"),
                         (["-H", "n1:2", "--hostfile", str(hostfile)], "-H/--hosts and --hostfile both give the hosts")):
        job = aiaccrun_cli("-np", "2", *flags, "--print-command", "python", "train.py")
        assert job.returncode == 2 and words in job.output, (flags, job.output)
    job = aiaccrun_cli("--check-build")
    assert job.returncode == 0 and "[X] PyTorch" in job.output and "[X] MPI" in job.output, job.output
    assert "[ ] Gloo" in job.output
    job = aiaccrun_cli("-np", "2", "--jsrun", "python", "-c", "print('RAN-IT')")  # (it took python as its value, -c as -cb)
    assert job.returncode == 2 and "--jsrun is not taken" in job.output and "RAN-IT" not in job.output, job.output
    job = aiaccrun_cli("-h")  # the closing table: every variable, AIACC_ENABLE without a flag of its own
    assert job.returncode == 0 and "--enable" not in job.output and "(aiaccrun sets it)" in job.output, job.output
    job = aiaccrun_cli("--version")
    assert job.returncode == 0 and job.output.strip() == "aiacc 0.1.0", job.output


def test_horovods_log_level_names_reach_the_ranks():
    job = aiaccrun(2, "exit_code.py", "0,0", flags=["--log-level", "TRACE", "--timeline-filename", "DYNAMIC"])
    assert job.returncode == 0, job.output


def test_exit_code_line_is_parsed_and_other_output_passes_through_in_pieces():
    from aiacc.launcher import ExitCodeFilter, worst_status

    seen = []
    f = ExitCodeFilter(None, seen.extend)
    out = f.feed(b"epoch 1 [") + f.feed(b"====   ]\rprogress\n[mpi") + f.feed(b"exec@n1] Exit codes: [n1] 0,1280 [n2] 9\n")
    out += f.feed(b"[mpiexec@n1] other news\ntail")
    assert out == b"epoch 1 [====   ]\rprogress\n[mpiexec@n1] other news\ntail"
    assert seen == [0, 1280, 9]
    assert worst_status(seen) == 137  # signal 9 is worse than exit status 5
    assert worst_status([0, 1280, 512]) == 5


def test_a_failure_names_every_failed_rank_since_mpi_may_record_its_cleanup_kills_too():
    """hydra kills the other ranks when one dies and at times records them as killed by signal 9 too (seen
    in CI): the restart message names each failed rank, so the one that died is always among them."""
    from aiacc.launcher import describe_failure

    assert describe_failure([0, 9], 137) == "rank 1 was killed by signal 9"
    assert describe_failure([9, 9], 137) == "rank 0 was killed by signal 9, rank 1 was killed by signal 9"
    assert describe_failure([0, 768, 15], 143) == "rank 1 exited with status 3, rank 2 was killed by signal 15"
    assert describe_failure([9] * 6, 137).endswith("rank 3 was killed by signal 9, 2 more")
    assert describe_failure([], 5) == "exit status 5" and describe_failure([0, 0], 1) == "exit status 1"


def test_exit_codes_of_several_hosts_on_their_own_lines_are_parsed_too():
    """hydra 5 puts each further host's exit codes on a line of its own (seen on the emulated cluster)."""
    from aiacc.launcher import ExitCodeFilter

    seen = []
    f = ExitCodeFilter(None, seen.extend)
    out = f.feed(b"rank output\n[mpiexec@vm] Exit codes: [10.213.1.1] 0,256\n[10.2") + f.feed(b"13.1.2] 512,768\n")
    out += f.feed(b"[not codes] a line\n")
    assert seen == [0, 256, 512, 768]
    assert out == b"rank output\n[not codes] a line\n"


def test_ranks_get_torchruns_variables():
    """torch.distributed's env:// rendezvous needs RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT: aiaccrun sets
    them (and LOCAL_RANK, LOCAL_WORLD_SIZE) from MPI on every rank, as torchrun does."""
    job = aiaccrun_cli("-np", "2", sys.executable, "-c",
                       "import os; os.write(1, ' '.join(['ENV', *(os.environ[k] for k in ('RANK', 'WORLD_SIZE', "
                       "'LOCAL_RANK', 'LOCAL_WORLD_SIZE', 'MASTER_ADDR')), str(int(os.environ['MASTER_PORT']) > 0)])"
                       ".encode() + b'\\n')")  # one write per line: the ranks' lines never interleave
    assert job.returncode == 0, job.output
    assert sorted(job.lines("ENV ")) == ["ENV 0 2 0 2 127.0.0.1 True", "ENV 1 2 1 2 127.0.0.1 True"], job.output


@pytest.mark.parametrize("enabled", [False, True])
def test_a_script_started_by_torchrun_is_told_to_start_with_aiaccrun(enabled, tmp_path):
    """torchrun starts its processes without MPI: each is a job of one, training alone on its own data without a word
    (before). Switched on, ``init()`` refuses that on every rank, naming torchrun and aiaccrun; switched off (aiacc's
    default outside aiaccrun), each rank warns that it trains alone."""
    need_framework("torch")
    job = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(WORKERS / "lone_rank.py")],  # (TMPDIR: torchrun leaves a torchelastic_* folder there)
              env={"TMPDIR": str(tmp_path), **({"AIACC_ENABLE": "1"} if enabled else {})})
    assert job.returncode == 0, job.output
    if enabled:
        refused = sorted(job.lines("REFUSED "))
        assert [line.split()[1] for line in refused] == ["rank=0", "rank=1"], job.output
        for line in refused:
            assert "RuntimeError: aiacc.init: torchrun started this process as one of 2 ranks (WORLD_SIZE=2), but " \
                   "MPI sees it alone, in a job of 1" in line, line
            assert "start the job with `aiaccrun -np 2 python train.py`" in line, line
        assert not job.lines("SIZE "), job.output
    else:
        assert job.output.count("aiacc is disabled (AIACC_ENABLE is not 1) but torchrun started this process as one "
                                "of 2 ranks (WORLD_SIZE=2): each rank trains alone") == 2, job.output
        assert sorted(job.lines("SIZE ")) == ["SIZE rank=0 1", "SIZE rank=1 1"], job.output


def test_a_process_spawned_by_a_rank_that_runs_init_again_is_told_to_guard_the_scripts_top_level():
    """With 'spawn' (a DataLoader's multiprocessing_context) the child imports the script again: init() at its top
    level started MPI there, which failed on the launcher's pipe with MPICH's "PMI_Init returned -1" and nothing
    about aiacc (before); now an error naming the process, the rank and the fix, before MPI starts. The rank itself
    goes on."""
    job = aiaccrun(2, "spawned_child.py", "toplevel", timeout=120)
    assert_ok(job, 2)
    assert sorted(job.lines("CHILD rank=")) == ["CHILD rank=0 exitcode=1", "CHILD rank=1 exitcode=1"], job.output
    for r in range(2):
        assert re.search(rf"AiaccError: aiacc.init\(\) was called in process SpawnProcess-1 \(pid \d+\), which "
                         rf"multiprocessing started from rank {r}: .* Put hvd.init\(\) and the training under "
                         r"`if __name__ == \"__main__\":`", job.output), job.output
    assert "PMI_Init" not in job.output, job.output


def test_a_spawned_process_that_asks_for_the_rank_is_told_where_aiacc_runs():
    job = aiaccrun(2, "spawned_child.py", "guarded", timeout=120)
    assert_ok(job, 2)
    errors = job.lines("CHILD error: ")
    assert len(errors) == 2 and all("NotInitializedError: aiacc.rank() was called before aiacc.init() in process "
                                    "SpawnProcess-1" in e and "aiacc runs in the rank's own process" in e
                                    for e in errors), job.output
    assert sorted(job.lines("CHILD rank=")) == ["CHILD rank=0 exitcode=0", "CHILD rank=1 exitcode=0"], job.output


def test_the_launcher_of_a_job_is_read_from_its_variables():
    assert launched_as({}) is None
    assert launched_as({"PMI_SIZE": "2", "OMPI_COMM_WORLD_SIZE": "3"}) == (2, "PMI_SIZE", "MPICH's mpiexec")
    assert launched_as({"OMPI_COMM_WORLD_SIZE": "4", "WORLD_SIZE": "4", "TORCHELASTIC_RUN_ID": "x"}) == \
        (4, "OMPI_COMM_WORLD_SIZE", "Open MPI's mpirun")
    # (aiaccrun sets WORLD_SIZE under MPICH's mpiexec: torchrun only where its own run id is there)
    assert launched_as({"WORLD_SIZE": "2"}) is None
    assert launched_as({"WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "x"}) == (2, "WORLD_SIZE", "torchrun")
    assert launched_as({"SLURM_NTASKS": "8"}) is None  # (an allocation, not a step)
    assert launched_as({"SLURM_NTASKS": "8", "SLURM_STEP_ID": "0"}) == (8, "SLURM_NTASKS", "Slurm's srun")
    assert launched_as({"PMI_SIZE": "x"}) is None


def test_ranks_per_emulated_host_gives_torchruns_local_variables_of_those_hosts():
    """--ranks-per-emulated-host 2 makes hosts {0,1} and {2}: LOCAL_RANK and LOCAL_WORLD_SIZE say the same as
    aiacc.local_rank() and local_size(), not the real host's 0-2 of 3."""
    code = ("import os, aiacc; aiacc.init(); os.write(1, ' '.join(['ENV', os.environ['RANK'], os.environ['LOCAL_RANK'], "
            "os.environ['LOCAL_WORLD_SIZE'], str(aiacc.local_rank()), str(aiacc.local_size())]).encode() + b'\\n')")
    job = aiaccrun_cli("-np", "3", "--ranks-per-emulated-host", "2", sys.executable, "-c", code)
    assert job.returncode == 0, job.output
    assert sorted(job.lines("ENV ")) == ["ENV 0 0 2 0 2", "ENV 1 1 2 1 2", "ENV 2 0 1 0 1"], job.output
    # '08' is 8 for aiacc's configuration (the rank shell line read it as octal: 'Illegal number', every rank died)
    job = aiaccrun_cli("-np", "3", sys.executable, "-c", code, env={"AIACC_HOSTS_PER_NODE": "08"})
    assert job.returncode == 0, job.output
    assert sorted(job.lines("ENV ")) == ["ENV 0 0 3 0 3", "ENV 1 1 3 1 3", "ENV 2 2 3 2 3"], job.output


def test_mpiexec_args_may_start_with_a_dash_and_the_commands_own_flags_stay_its_own():
    for form in (["--mpiexec-args", "-verbose"], ["--mpi-args", "-verbose"], ["--mpiexec-args=-verbose"]):
        job = aiaccrun_cli("-np", "2", *form, "--print-command", "python", "train.py", "--mpi-args", "-x")
        assert job.returncode == 0, (form, job.output)
        assert " -verbose " in job.output and job.output.strip().endswith("python train.py --mpi-args -x"), job.output


def test_a_script_given_without_python_is_refused_naming_it_and_the_command_to_type(tmp_path):
    """`aiaccrun -np 2 train.py` with train.py in the working directory: every rank said "exec: train.py: not
    found" (and ./train.py, not executable: "Permission denied"); now one error before anything starts."""
    (tmp_path / "train.py").write_text("print('TRAINED')\n")
    for script, words in (("train.py", "'train.py' is a file here, not a command on PATH: run it as "
                                       "`aiaccrun -np 2 python train.py --epochs 1`"),
                          ("./train.py", "'./train.py' is not executable: run it as `aiaccrun -np 2 python "
                                         "./train.py --epochs 1` or make it executable (chmod +x)")):
        job = subprocess.run([sys.executable, "-m", "aiacc.launcher", "-np", "2", script, "--epochs", "1"],
                             cwd=tmp_path, env=base_env(), capture_output=True, text=True, timeout=60)
        assert job.returncode == 2 and words in job.stderr, job.stdout + job.stderr


def test_the_ranks_end_when_aiaccrun_is_killed_by_sigkill(tmp_path):
    """A scheduler's SIGKILL (or ``timeout -k``) to aiaccrun: mpiexec and the ranks went on running, orphaned, with
    nobody collecting their output or exit status (horovodrun's middleman ends them). mpiexec now gets SIGTERM."""
    import signal  # noqa: PLC0415
    import time  # noqa: PLC0415

    code = ("import os, sys, time, aiacc; aiacc.init()\n"
            "open(os.path.join(sys.argv[1], f'rank{aiacc.rank()}'), 'w').write(str(os.getpid()))\n"
            "time.sleep(300)\n")
    proc = subprocess.Popen([sys.executable, "-m", "aiacc.launcher", "-np", "2", sys.executable, "-c", code,
                             str(tmp_path)], env=base_env(), start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def alive(pid):
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # (a zombie has ended)
        except FileNotFoundError:
            return False

    files = [tmp_path / f"rank{r}" for r in range(2)]
    pids = []
    try:
        deadline = time.monotonic() + 90
        while not all(f.exists() and f.read_text() for f in files):
            assert time.monotonic() < deadline and proc.poll() is None, "the job did not start"
            time.sleep(0.2)
        pids = [int(f.read_text()) for f in files]
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 60  # (hydra ends them within a few seconds)
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(alive(p) for p in pids), "the ranks went on running after aiaccrun was killed"
    finally:
        for p in pids:
            if alive(p):
                os.kill(p, signal.SIGKILL)
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # (mpiexec, its proxy, if left)
        except ProcessLookupError:
            pass
