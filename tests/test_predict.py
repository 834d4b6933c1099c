"""``python -m aiacc.bench predict``: the alpha-beta model with hierarchy, and its comparison with a run."""

import json
import os
import shutil
import sys

import pytest

from aiacc.bench.predict import Network, StepTimeline, allreduce_seconds, plan_buckets, predict_step
from conftest import need_framework, run

needs_root = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("tc") is None,
                                reason="network namespaces need root and iproute2 (tc)")
MiB = 1 << 20


def test_buckets_close_at_their_caps_and_are_ready_with_their_last_gradient():
    ready = [(0.1, MiB // 2), (0.2, MiB // 2), (0.3, 10 * MiB), (0.4, 20 * MiB), (0.5, 4)]
    # the first closes at 1 MiB, the next once it holds 25 MiB, the rest is one more
    assert plan_buckets(ready, cap=25 * MiB) == [(0.2, MiB), (0.4, 30 * MiB), (0.5, 4)]


def test_a_flat_ring_crosses_the_hosts_with_one_and_a_half_times_the_bytes_of_a_hierarchical_allreduce():
    fast = float("inf")
    net = Network(hosts=2, ranks_per_host=2, link_Bps=100e6, shm_Bps=fast, loopback_Bps=fast, alpha_s=0.0,
                  overhead_s=0.0)
    n = 100e6
    assert allreduce_seconds("aiacc-hier", n, net) == pytest.approx(1.0)  # 2 (H-1)/H n / beta
    assert allreduce_seconds("ddp", n, net) == pytest.approx(1.5)  # 2 (N-1)/N n / beta
    one = net._replace(hosts=1, ranks_per_host=1)
    assert allreduce_seconds("aiacc", n, one) == 0.0 and allreduce_seconds("ddp", n, one) == 0.0


def test_16bit_gradients_cross_with_half_the_bytes_and_pay_for_their_casts():
    fast = float("inf")
    net = Network(hosts=2, ranks_per_host=2, link_Bps=100e6, shm_Bps=fast, loopback_Bps=fast, alpha_s=0.0,
                  overhead_s=0.0, cast_eps=1e9)
    n = 100e6  # 25 M float32 elements: aiacc casts each 4 times, DDP's hook twice, at 1e9 per second
    assert allreduce_seconds("aiacc-fp16", n, net) == pytest.approx(0.5 + 0.1)
    assert allreduce_seconds("aiacc-bf16", n, net) == pytest.approx(0.5 + 0.1)
    assert allreduce_seconds("ddp-fp16", n, net) == pytest.approx(0.75 + 0.05)


def test_communication_hides_behind_backward_only_as_far_as_it_fits():
    net = Network(2, 1, link_Bps=1e6, shm_Bps=1e9, loopback_Bps=1e9, alpha_s=0.0, overhead_s=0.0)
    # one 2 MiB bucket ready 0.1 s into a 1 s backward: 2.1 s of link time, 1.2 s of it exposed
    timeline = StepTimeline(forward_s=0.5, backward_s=1.0, optimizer_s=0.1, ready=[(0.1, 2 * MiB)])
    p = predict_step(timeline, "aiacc", net, cap=25 * MiB)
    cost = 2 * (1 / 2) * 2 * MiB / 1e6
    assert p.buckets == 1 and p.comm_s == pytest.approx(cost)
    assert p.step_s == pytest.approx(0.5 + 0.1 + cost + 0.1) and p.compute_s == pytest.approx(1.6)
    quick = predict_step(timeline, "aiacc", net._replace(link_Bps=1e9), cap=25 * MiB)
    assert quick.step_s == pytest.approx(1.6) and quick.scaling_eff == pytest.approx(1.0)


def test_predict_prints_a_line_per_implementation_with_what_it_assumed():
    job = run([sys.executable, "-m", "aiacc.bench", "predict", "--profile", "resnet50_v100", "--hosts", "64",
               "--ranks-per-host", "4", "--link", "100gbit", "--dilate", "1", "--timeline", "profile",
               "--impls", "aiacc,aiacc-hier,ddp"], timeout=60)
    assert job.returncode == 0, job.output
    lines = job.lines("impl=")
    assert [line.split()[0] for line in lines] == ["impl=aiacc", "impl=aiacc-hier", "impl=ddp"]
    for line in lines:
        assert "ranks=256 hosts=64" in line and "predicted_step_ms=" in line
        eff = float(line.split("predicted_scaling_eff=")[1].split()[0])
        assert 0 < eff <= 1
    assert job.lines("assumed: timeline=profile link_MBps=11000.0")  # 100 Gbit/s x 0.88
    bad = run([sys.executable, "-m", "aiacc.bench", "predict", "--impls", "nccl"], timeout=60)
    assert bad.returncode == 2 and "--impls: unknown nccl" in bad.output


@needs_root
def test_measure_runs_the_emulated_cluster_and_prints_both_step_times():
    need_framework("torch")
    job = run([sys.executable, "-m", "aiacc.bench", "predict", "--profile", "cnn", "--hosts", "2", "--ranks-per-host",
               "1", "--link", "1gbit", "--dilate", "0.2", "--measure", "--steps", "2", "--warmup", "1",
               "--repeats", "1", "--json"], timeout=240)
    assert job.returncode == 0, job.output
    recs = [json.loads(line) for line in job.lines("{")]
    assert [r["impl"] for r in recs] == ["aiacc", "ddp"], job.output
    for r in recs:
        assert r["predicted_step_ms"] > 0 and r["measured_step_ms"] > 0
        assert r["error"] == pytest.approx((r["predicted_step_ms"] - r["measured_step_ms"]) / r["measured_step_ms"])
