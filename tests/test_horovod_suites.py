"""tools/horovod_suites.py: Horovod's test suites run against aiacc, without Horovod's repository.

A tiny Horovod-like repository made in tmp_path stands in for Horovod's: one test passes, one fails,
one hangs on rank 1 only. The runner must count each right, charge the hang to its own test only
(the test after it still runs, in a restarted job), finish in bounded time and leave no rank behind.
"""

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import ROOT, run

TOOL = ROOT / "tools" / "horovod_suites.py"

FAKE_SUITE = '''
import time

import torch

import horovod.torch as hvd


def test_a_passes():
    hvd.init()
    out = hvd.allreduce(torch.ones(3) * (hvd.rank() + 1), op=hvd.Sum)
    assert out.tolist() == [3.0, 3.0, 3.0]


def test_b_hangs_on_rank_1():
    hvd.init()
    if hvd.rank() == 1:
        time.sleep(3600)


def test_c_fails():
    hvd.init()
    out = hvd.allreduce(torch.ones(2), op=hvd.Sum)  # rank 0 waits here for rank 1 while b hangs
    assert out.tolist() == [0.0, 0.0], "deliberately wrong"
'''


def _tool_module():
    if "horovod_suites_under_test" not in sys.modules:  # tools/ is not a package: load the file
        spec = importlib.util.spec_from_file_location("horovod_suites_under_test", TOOL)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    return sys.modules["horovod_suites_under_test"]


def _fake_horovod(root: Path) -> Path:
    (root / "test" / "parallel").mkdir(parents=True)
    (root / "test" / "utils").mkdir()
    (root / "test" / "parallel" / "test_fake.py").write_text(FAKE_SUITE)
    (root / "test" / "utils" / "common.py").write_text("HELPER = 1\n")
    return root


def _processes_naming(text: str):
    mine = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if text.encode() in (entry / "cmdline").read_bytes():
                    mine.append(int(entry.name))
            except OSError:
                pass
    return mine


def test_pass_fail_and_a_hang_on_one_rank_are_counted_and_the_hang_costs_only_its_test(tmp_path):
    pytest.importorskip("torch")
    horovod = _fake_horovod(tmp_path / "horovod")
    out_json, work = tmp_path / "out.json", tmp_path / "work"
    job = run([sys.executable, str(TOOL), "--horovod", str(horovod), "test/parallel/test_fake.py",
               "--np", "2", "--test-timeout", "10", "--json", str(out_json), "--work-dir", str(work)],
              timeout=100)
    assert job.returncode == 1, job.output  # something failed
    report = json.loads(out_json.read_text())["reports"][0]
    assert report["counts"] == {"passed": 1, "failed": 1, "skipped": 0, "hang": 1, "abort": 0, "not run": 0}, job.output
    by_name = {t["nodeid"].split("::")[-1]: t for t in report["tests"]}
    assert by_name["test_a_passes"]["outcome"] == "passed"
    assert by_name["test_b_hangs_on_rank_1"]["outcome"] == "hang"
    assert "rank 1" in by_name["test_b_hangs_on_rank_1"]["message"]
    assert by_name["test_c_fails"]["outcome"] == "failed"
    assert "deliberately wrong" in by_name["test_c_fails"]["message"]
    assert report["jobs"] == 2  # killed at the hang, restarted with test_c only
    # the table names the failing tests with their first error line
    assert "hang   test_b_hangs_on_rank_1: no result after 10 s on rank 1" in job.output
    assert "failed test_c_fails: rank 0: AssertionError: deliberately wrong" in job.output
    assert job.seconds < 80
    assert _processes_naming(str(work)) == []  # the hung rank was killed


def test_alias_maps_horovod_modules_to_aiacc_and_refuses_what_aiacc_lacks(tmp_path):
    pytest.importorskip("torch")
    _tool_module().prepare_alias(tmp_path)
    code = textwrap.dedent("""
        import aiacc.torch, horovod.torch as hvd
        assert hvd is aiacc.torch
        from horovod.common.util import is_version_greater_equal_than
        assert is_version_greater_equal_than("2.21.0", "2.6.0")
        import horovod.torch.elastic, aiacc.torch.elastic
        assert horovod.torch.elastic is aiacc.torch.elastic
        for name in ("horovod.torch.mpi_lib_v2", "horovod.spark"):
            try:
                __import__(name)
            except ModuleNotFoundError as exc:
                print(name, "->", exc)
            else:
                raise AssertionError(name)
    """)
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "horovod.torch.mpi_lib_v2 -> No module named 'horovod.torch.mpi_lib_v2': aiacc has no " \
        "'aiacc.torch.mpi_lib_v2'" in out.stdout, out.stdout
    assert "horovod.spark -> No module named 'horovod.spark': the alias of tools/horovod_suites.py maps only" \
        in out.stdout


def test_horovod_files_are_read_from_a_git_directory_without_a_work_tree(tmp_path):
    src = _fake_horovod(tmp_path / "src")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(git + ["init", "-q", str(src)], check=True)
    subprocess.run(git + ["-C", str(src), "add", "-A"], check=True)
    subprocess.run(git + ["-C", str(src), "commit", "-q", "-m", "fake"], check=True)
    bare = tmp_path / "bare.git"
    subprocess.run(["git", "clone", "-q", "--bare", str(src), str(bare)], check=True)
    dest = tmp_path / "out"
    source = _tool_module().materialize(bare, dest)
    assert source.startswith(f"git {bare} at ")
    assert (dest / "test" / "parallel" / "test_fake.py").read_text() == FAKE_SUITE
    assert (dest / "test" / "utils" / "common.py").is_file()
