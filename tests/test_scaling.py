"""``python -m aiacc.bench scaling``: every figure printed and sane, on a tiny emulated cluster."""

import json
import os
import shutil
import sys

import pytest

from aiacc.bench.scaling import _print, derive
from conftest import need_framework, run

needs_root = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("tc") is None,
                                reason="network namespaces need root and iproute2 (tc)")


def scaling(*args, timeout=240):
    return run([sys.executable, "-m", "aiacc.bench", "scaling", *args], timeout=timeout)


def test_efficiencies_follow_their_definitions():
    raw = {"impl": "aiacc", "profile": "p", "ranks": 4, "hosts": 2, "batch": 8, "dilate": 10.0, "link": "1gbit",
           "step_s": 0.5, "compute_s": 0.4, "comm_s": 0.2}
    rec = derive(raw, ddp_step_s=0.6)
    assert rec["scaling_eff"] == pytest.approx(0.8)  # T_compute / T_step
    assert rec["overlap_eff"] == pytest.approx(0.5)  # 0.1 s of 0.2 s communication exposed
    assert rec["samples_per_s"] == pytest.approx(4 * 8 * 10 / 0.5)  # undilated time
    assert rec["vs_ddp"] == pytest.approx(1.2)
    # nothing hidden, or everything: clamped to [0, 1]
    assert derive(dict(raw, step_s=0.9), None)["overlap_eff"] == 0.0
    assert derive(dict(raw, step_s=0.39), None)["overlap_eff"] == 1.0


def test_lines_carry_every_field(capsys):
    rec = derive({"impl": "ddp", "profile": "p", "ranks": 4, "hosts": 2, "batch": 8, "dilate": 10.0, "link": "1gbit",
                  "step_s": 0.5, "compute_s": 0.4, "comm_s": 0.2}, 0.5)
    _print([rec], as_json=False)
    line = capsys.readouterr().out.strip()
    assert line.startswith("impl=ddp ranks=4 hosts=2 link=1gbit ")
    for key in ("samples_per_s=640.0", "scaling_eff=0.800", "overlap_eff=0.500", "vs_ddp=1.000"):
        assert key in line, line


def test_bad_arguments_are_named():
    job = scaling("--impls", "aiacc,horovod")
    assert job.returncode == 2 and "--impls: unknown horovod" in job.output, job.output
    job = scaling("--profile", "resnet51")
    assert job.returncode == 2 and "no profile 'resnet51'" in job.output, job.output
    job = scaling("--dilate", "0")
    assert job.returncode == 2 and "argument --dilate: expected a finite number > 0, got '0'" in job.output, job.output


@needs_root
def test_tiny_run_prints_every_figure_for_each_implementation(tmp_path):
    need_framework("torch")
    plot = tmp_path / "scaling.png"
    # a sweep over 1 and 2 hosts; aiacc-hier runs in a job of its own on each
    job = scaling("--profile", "cnn", "--hosts", "1,2", "--ranks-per-host", "1", "--link", "1gbit", "--dilate", "0.2",
                  "--steps", "2", "--warmup", "1", "--repeats", "1", "--impls", "aiacc,aiacc-hier,ddp,aiacc-fp16,ddp-fp16,aiacc-bf16",
                  "--json",
                  "--plot", str(plot))
    assert job.returncode == 0, job.output
    recs = [json.loads(line) for line in job.lines("{")]
    order = ["aiacc", "ddp", "aiacc-fp16", "ddp-fp16", "aiacc-bf16", "aiacc-hier"]  # (aiacc-hier: a job of its own)
    assert [(r["impl"], r["hosts"]) for r in recs] == [(i, h) for h in (1, 2) for i in order], job.output
    for r in recs:
        assert (r["ranks"], r["link"], r["profile"]) == (r["hosts"], "1gbit", "cnn"), r
        assert r["samples_per_s"] > 0 and r["step_ms"] > 0 and r["compute_ms"] > 0 and r["comm_ms"] >= 0, r
        assert 0 < r["scaling_eff"] <= 1.2, r
        assert 0 <= r["overlap_eff"] <= 1, r
        assert r["vs_ddp"] > 0, r
    assert recs[1]["vs_ddp"] == recs[7]["vs_ddp"] == 1.0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
