"""Compute replay (aiacc.bench.replay): real gradient shapes in the real order, a GPU's time slept."""

import json
import sys

import pytest

from aiacc.bench.replay import ProfileError, expected_gradient, load_profile, profile_names
from aiacc.bench.replay_profiles import bert_base_layers, finish, resnet50_layers
from conftest import TENSORFLOW, aiaccrun, assert_ok, need_framework, run


def test_stored_profiles_have_the_real_networks_and_cite_their_figure():
    assert {"resnet50_v100", "bert_base_v100", "cnn", "transformer"} <= set(profile_names())
    resnet, bert = load_profile("resnet50_v100"), load_profile("bert_base_v100")
    # torchvision's resnet50: 161 parameter tensors, 25,557,032 parameters; fc last, conv1 first
    assert len(resnet.tensors) == 161 and resnet.parameters == 25_557_032
    assert resnet.tensors[0] == ("conv1.weight", (64, 3, 7, 7)) and resnet.tensors[-2] == ("fc.weight", (1000, 2048))
    assert ("layer4.0.downsample.0.weight", (2048, 1024, 1, 1)) in resnet.tensors
    # BERT-base: ~110 M parameters in ~200 tensors, the word embedding its largest
    assert len(bert.tensors) == 201 and 109e6 < bert.parameters < 111e6
    assert bert.tensors[0] == ("embeddings.word_embeddings.weight", (30522, 768))
    for prof in (resnet, bert):
        meta = prof.meta
        for key in ("source", "device", "precision", "batch_size", "samples_per_s", "source_is_exact"):
            assert meta.get(key) not in (None, ""), (prof.name, key)
        # the whole step is the cited throughput, and the layers add up to it
        assert prof.step_ms == pytest.approx(1e3 * prof.batch_size / meta["samples_per_s"], rel=1e-6)
        assert prof.compute_ms == pytest.approx(prof.step_ms, rel=1e-4)
    assert resnet.meta["samples_per_s"] == 1270.0 and resnet.batch_size == 256
    assert bert.meta["source_is_exact"] is False  # derived, and says so


def test_layer_times_follow_flops_with_backward_twice_forward():
    resnet = load_profile("resnet50_v100")
    conv1 = resnet.layers[0]
    assert conv1.flops == 2 * 7 * 7 * 3 * 64 * 112 * 112
    # 4.1 GMACs per image, the usual figure for ResNet-50 v1.5 at 224x224
    assert sum(lay.flops for lay in resnet.layers) == pytest.approx(8.18e9, rel=0.01)
    rate = resnet.layers[0].forward_ms / resnet.layers[0].flops
    assert all(lay.forward_ms == pytest.approx(rate * lay.flops, rel=1e-4, abs=1e-6) for lay in resnet.layers)
    assert all(lay.backward_ms == pytest.approx(2 * lay.forward_ms, rel=1e-5) for lay in resnet.layers)


def test_stored_profiles_are_what_the_generator_makes():
    from aiacc.bench.replay_profiles import BERT_BASE_V100, RESNET50_V100

    assert finish(RESNET50_V100, resnet50_layers()) == load_profile_raw("resnet50_v100")
    assert finish(BERT_BASE_V100, bert_base_layers()) == load_profile_raw("bert_base_v100")


def load_profile_raw(name):
    from aiacc.bench.replay import PROFILE_DIR

    with open(f"{PROFILE_DIR}/{name}.json") as f:
        return json.load(f)


def test_unknown_profile_names_the_stored_ones():
    with pytest.raises(ProfileError, match="no profile 'resnet51'.*resnet50_v100"):
        load_profile("resnet51")
    job = run([sys.executable, "-m", "aiacc.bench", "replay", "--profile", "resnet51"], timeout=60)
    assert job.returncode == 2 and "stored profiles are" in job.output, job.output


class TestTorch:
    @pytest.fixture(autouse=True)
    def _torch(self):
        need_framework("torch")

    def test_bench_model_profiles_have_the_real_models_shapes(self):
        import torch

        from aiacc.bench.train_torch import build_model

        for name in ("cnn", "transformer"):
            torch.manual_seed(0)
            real = sorted((n, tuple(p.shape)) for n, p in build_model(name).named_parameters())
            assert sorted(load_profile(name).tensors) == real, name

    def test_gradients_arrive_layer_by_layer_in_reverse_with_the_profiles_sizes(self):
        import torch

        from aiacc.bench.replay import build_model

        profile = load_profile("resnet50_v100")
        model = build_model(profile, dilate=0)
        layer_of, seen = model.layer_of(), []
        names = {id(p): n for n, p in model.named_parameters()}
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(lambda p: seen.append((layer_of[id(p)], names[id(p)], p.grad)))
        model(torch.full((4,), 3.0)).mean().backward()
        assert len(seen) == 161
        order = [i for i, _, _ in seen]
        assert order == sorted(order, reverse=True) and order[0] == len(profile.layers) - 1 and order[-1] == 0
        shapes = dict(profile.tensors)
        for i, name, grad in seen:
            assert tuple(grad.shape) == shapes[name]
            assert torch.equal(grad, torch.full_like(grad, expected_gradient(i, 3.0)))
        # every layer asked for nothing (dilate 0), yet ran both phases
        assert model.clock.requested_s == 0 and model.clock.sleeps == 2 * len(profile.layers)

    def test_a_step_asks_for_the_profiles_time_dilated(self):
        import torch

        from aiacc.bench.replay import build_model

        profile = load_profile("transformer")
        model = build_model(profile, dilate=0.02)
        for _ in range(2):
            model(torch.ones(2)).mean().backward()
        assert model.clock.sleeps == 2 * 2 * len(profile.layers)
        assert model.clock.requested_s == pytest.approx(2 * 0.02 * profile.compute_ms * 1e-3, rel=1e-9)
        assert 0 <= model.clock.slept_s <= model.clock.requested_s
        with pytest.raises(ValueError, match="dilate must be >= 0"):
            build_model(profile, dilate=-1)

    def test_kept_gradients_are_rewritten_not_accumulated_and_no_update_leaves_parameters(self):
        import torch

        from aiacc.bench.replay import build_model, no_update_optimizer

        profile = load_profile("cnn")
        model = build_model(profile, dilate=0)
        opt = no_update_optimizer(model.parameters())
        for mean in (2.0, 5.0):
            opt.zero_grad(set_to_none=False)
            model(torch.full((3,), mean)).mean().backward()
            opt.step()
        for i, (_, params, _) in enumerate(model._replay):
            for p in params:
                assert torch.equal(p.grad, torch.full_like(p, expected_gradient(i, 5.0)))
                assert p.grad.is_contiguous() and not torch.any(p.detach())

    def test_replay_command_prints_the_profile_and_its_step(self):
        job = run([sys.executable, "-m", "aiacc.bench", "replay", "--profile", "cnn", "--dilate", "0.01",
                   "--steps", "1", "--json"], timeout=60)
        assert job.returncode == 0, job.output
        rec = json.loads(job.lines("{")[0])
        assert rec["tensors"] == 10 and rec["params"] == 2_193_226 and rec["step_ms"] > 0
        assert rec["requested_ms"] == pytest.approx(0.01 * load_profile("cnn").compute_ms, rel=1e-6)

    @pytest.mark.parametrize("profile,grads", [("cnn", "keep"), ("transformer", "none")])
    def test_aiacc_and_ddp_train_the_replay_model_to_the_same_parameters(self, profile, grads):
        job = aiaccrun(2, "replay_ddp.py", profile, "0.02", grads, timeout=120)
        checks = 3 * 2 + 1 + len(load_profile(profile).tensors)
        assert_ok(job, 2, checks=checks)


def test_tensorflow_replay_trains_under_distributed_gradient_tape_to_the_closed_form():
    need_framework("tensorflow", TENSORFLOW)
    job = aiaccrun(2, "tf_replay.py", "transformer", "0.02", timeout=180)
    assert_ok(job, 2, checks=2 + len(load_profile("transformer").tensors))


def test_mxnet_replay_trains_under_distributed_trainer_to_the_closed_form():
    need_framework("mxnet")
    job = aiaccrun(2, "mx_replay.py", "transformer", "0.02", timeout=180)
    assert_ok(job, 2, checks=2 + len(load_profile("transformer").tensors))
