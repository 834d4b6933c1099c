"""How the stored compute profiles in ``bench/profiles/`` were made: ``python -m aiacc.bench.replay_profiles``.

A profile lists a network's layers in forward order; each layer has the real parameter tensors
(names and shapes as the reference implementation names them), its forward FLOPs per sample, and
forward/backward milliseconds. The whole step's time comes from one figure the profile cites
(``step_ms`` = ``batch_size`` / ``samples_per_s``); it is split over layers in proportion to their
FLOPs, backward taking twice the forward (``forward_ms = step_ms * flops / (3 * total_flops)``).

FLOPs per sample (multiply-add = 2 FLOPs): a convolution ``2*k*k*cin*cout*H*W`` (H, W of its
output); a dense layer ``2*in*out`` per token; attention ``2*seq*d`` for the scores and the same for
the weighted sum, per token; a normalisation ``5*C*H*W`` (it has no matmul, and would otherwise get
no time at all). Batch norm and ReLU are folded into the convolution before them, as a GPU
framework fuses or schedules them, so a layer of the replay is "conv + its batch norm".

The bench's own ``cnn`` and ``transformer`` have no published GPU time: their step time is the one
measured on the development machine (``measure_cpu_step_ms``: real model, one thread, batch 32,
forward + backward + SGD step, median), so that a replay of them mirrors ``bench train`` without
compute and communication fighting for the same two cores.

This module needs no framework for ResNet-50 and BERT-base; the bench models' shapes are read from
the real torch model (``aiacc.bench.train_torch.build_model``).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Dict, List, Tuple

__all__ = ["resnet50_layers", "bert_base_layers", "bench_model_layers", "finish", "write_all", "PROFILE_DIR"]

PROFILE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "profiles")

Layer = Dict[str, object]


def _layer(name: str, params: List[Tuple[str, List[int]]], flops: float) -> Layer:
    return {"name": name, "params": [{"name": n, "shape": list(s)} for n, s in params], "flops": float(flops)}


def resnet50_layers() -> List[Layer]:
    """ResNet-50 v1.5 at 224x224 (torchvision's names): 53 conv+bn layers and fc, 161 tensors."""
    layers: List[Layer] = []

    def conv_bn(conv: str, bn: str, cin: int, cout: int, k: int, out_hw: int) -> None:
        flops = 2 * k * k * cin * cout * out_hw * out_hw
        layers.append(_layer(conv, [(f"{conv}.weight", [cout, cin, k, k]), (f"{bn}.weight", [cout]),
                                    (f"{bn}.bias", [cout])], flops))

    conv_bn("conv1", "bn1", 3, 64, 7, 112)
    inplanes, hw = 64, 56  # after the stride-2 stem and the 3x3 max pool
    for stage, (planes, blocks) in enumerate([(64, 3), (128, 4), (256, 6), (512, 3)], start=1):
        for b in range(blocks):
            stride = 2 if (b == 0 and stage > 1) else 1
            out_hw = hw // stride
            p = f"layer{stage}.{b}"
            conv_bn(f"{p}.conv1", f"{p}.bn1", inplanes, planes, 1, hw)  # v1.5: the stride is in the 3x3
            conv_bn(f"{p}.conv2", f"{p}.bn2", planes, planes, 3, out_hw)
            conv_bn(f"{p}.conv3", f"{p}.bn3", planes, planes * 4, 1, out_hw)
            if b == 0:
                conv_bn(f"{p}.downsample.0", f"{p}.downsample.1", inplanes, planes * 4, 1, out_hw)
            inplanes, hw = planes * 4, out_hw
    layers.append(_layer("fc", [("fc.weight", [1000, 2048]), ("fc.bias", [1000])], 2 * 2048 * 1000))
    return layers


def bert_base_layers(seq: int = 128, vocab: int = 30522, d: int = 768, ff: int = 3072, n_layers: int = 12,
                     classes: int = 2) -> List[Layer]:
    """BERT-base (Hugging Face's names) with pooler and a sequence-classification head: 201 tensors."""
    e = "embeddings"
    layers = [_layer(e, [(f"{e}.word_embeddings.weight", [vocab, d]), (f"{e}.position_embeddings.weight", [512, d]),
                         (f"{e}.token_type_embeddings.weight", [2, d]), (f"{e}.LayerNorm.weight", [d]),
                         (f"{e}.LayerNorm.bias", [d])], 5 * d * seq)]
    for i in range(n_layers):
        p = f"encoder.layer.{i}"
        s = f"{p}.attention.self"
        qkv = [(f"{s}.{m}.{w}", [d, d] if w == "weight" else [d]) for m in ("query", "key", "value")
               for w in ("weight", "bias")]
        layers.append(_layer(s, qkv, seq * (3 * 2 * d * d + 2 * 2 * seq * d)))
        o = f"{p}.attention.output"
        layers.append(_layer(o, [(f"{o}.dense.weight", [d, d]), (f"{o}.dense.bias", [d]),
                                 (f"{o}.LayerNorm.weight", [d]), (f"{o}.LayerNorm.bias", [d])],
                             seq * (2 * d * d + 5 * d)))
        m = f"{p}.intermediate"
        layers.append(_layer(m, [(f"{m}.dense.weight", [ff, d]), (f"{m}.dense.bias", [ff])], seq * 2 * d * ff))
        o = f"{p}.output"
        layers.append(_layer(o, [(f"{o}.dense.weight", [d, ff]), (f"{o}.dense.bias", [d]),
                                 (f"{o}.LayerNorm.weight", [d]), (f"{o}.LayerNorm.bias", [d])],
                             seq * (2 * d * ff + 5 * d)))
    layers.append(_layer("head", [("pooler.dense.weight", [d, d]), ("pooler.dense.bias", [d]),
                                  ("classifier.weight", [classes, d]), ("classifier.bias", [classes])],
                         2 * d * d + 2 * d * classes))  # the pooler and the classifier see the first token only
    return layers


def bench_model_layers(name: str) -> List[Layer]:
    """The bench's ``cnn`` or ``transformer`` (``aiacc.bench.common.MODELS``) with the real model's
    parameter names and shapes, grouped into its conv/dense layers (cnn) or attention and
    feed-forward blocks (transformer)."""
    import torch  # noqa: PLC0415

    from .common import MODELS  # noqa: PLC0415
    from .train_torch import build_model  # noqa: PLC0415

    torch.manual_seed(0)
    shapes = [(n, list(p.shape)) for n, p in build_model(name).named_parameters()]
    spec = MODELS[name]
    groups: List[Tuple[str, int, float]] = []  # (layer name, number of tensors, flops)
    if name == "cnn":
        (c0, side, _), (c1, c2, c3) = spec["image"], spec["channels"]
        flat = c3 * (side // 4) ** 2
        groups = [("0", 2, 2 * 9 * c0 * c1 * side ** 2), ("2", 2, 2 * 9 * c1 * c2 * side ** 2),
                  ("5", 2, 2 * 9 * c2 * c3 * (side // 2) ** 2), ("9", 2, 2 * flat * spec["hidden"]),
                  ("11", 2, 2 * spec["hidden"] * spec["classes"])]
    elif name in ("transformer", "narrow"):
        seq, d, ff = spec["seq"], spec["d_model"], spec["ff"]
        groups = [("embed", 1, 0.0)]
        for i in range(spec["layers"]):
            groups += [(f"layers.{i}.attention", 6, seq * (3 * 2 * d * d + 2 * 2 * seq * d + 2 * d * d + 5 * d)),
                       (f"layers.{i}.feedforward", 6, seq * (2 * 2 * d * ff + 5 * d))]
        groups.append(("head", 2, 2 * d * spec["classes"]))
    else:
        raise ValueError(f"no layer grouping for bench model {name!r}")
    layers, at = [], 0
    # named_parameters orders an encoder layer's tensors as in_proj, out_proj, linear1, linear2,
    # norm1, norm2: the attention block is in_proj, out_proj and norm1, the feed-forward the rest
    for layer_name, count, flops in groups:
        if layer_name.endswith(".attention"):
            prefix = layer_name.rsplit(".", 1)[0]
            take = [s for s in shapes if s[0].startswith(prefix + ".") and
                    (".self_attn." in s[0] or ".norm1." in s[0])]
        elif layer_name.endswith(".feedforward"):
            prefix = layer_name.rsplit(".", 1)[0]
            take = [s for s in shapes if s[0].startswith(prefix + ".") and
                    (".linear" in s[0] or ".norm2." in s[0])]
        else:
            take = shapes[at:at + count]
        assert len(take) == count, (layer_name, take)
        at += count
        layers.append(_layer(layer_name, take, flops))
    assert sum(len(lay["params"]) for lay in layers) == len(shapes)
    return layers


def measure_cpu_step_ms(name: str, batch: int = 32, steps: int = 20) -> float:
    """Median ms of a forward + backward + SGD step of the real bench model here (one thread)."""
    import time  # noqa: PLC0415

    import torch  # noqa: PLC0415

    from .train_torch import build_model, synthetic_batch  # noqa: PLC0415

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_model(name)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = synthetic_batch(name, batch, torch.Generator().manual_seed(0))
    loss_fn = torch.nn.CrossEntropyLoss()
    times = []
    for i in range(steps + 3):
        t0 = time.perf_counter()
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2] * 1e3


def finish(meta: dict, layers: List[Layer]) -> dict:
    """The profile: ``meta`` (with ``batch_size`` and ``samples_per_s``) plus layers whose
    forward/backward times split ``step_ms`` in proportion to FLOPs (backward = 2 x forward)."""
    step_ms = 1e3 * meta["batch_size"] / meta["samples_per_s"]
    total = sum(lay["flops"] for lay in layers)
    for lay in layers:
        fwd = step_ms * lay["flops"] / (3 * total)
        lay["forward_ms"], lay["backward_ms"] = round(fwd, 6), round(2 * fwd, 6)
    params = sum(_numel(p["shape"]) for lay in layers for p in lay["params"])
    return dict(meta, step_ms=round(step_ms, 4), split="forward:backward = 1:2 per layer, layers by FLOPs",
                flops_per_sample_forward=total, parameters=params,
                tensors=sum(len(lay["params"]) for lay in layers), layers=layers)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


RESNET50_V100 = {
    "name": "resnet50_v100",
    "model": "ResNet-50 v1.5, 224x224 (torchvision parameter names)",
    "device": "1x NVIDIA V100 16GB (DGX-1)",
    "batch_size": 256,
    "precision": "mixed precision (AMP) + XLA",
    "samples_per_s": 1270.0,
    "source": ("NVIDIA DeepLearningExamples, TensorFlow/Classification/ConvNets/resnet50v1.5/README.md, "
               "'Training performance: NVIDIA DGX-1 (8x V100 16G)', TensorFlow 20.06-tf1-py3 container: "
               "1 GPU, batch 256 (AMP), 1270 img/s mixed precision + XLA"),
    "source_is_exact": True,
    "note": ("Published whole-step throughput of one V100; the per-layer split is by FLOPs (no per-layer "
             "measurement is published). The optimizer update's time is inside the layers' times."),
}

BERT_BASE_V100 = {
    "name": "bert_base_v100",
    "model": "BERT-base uncased (12 layers, d=768, ff=3072, vocab 30522), sequence 128, pooler + 2-way classifier "
             "(Hugging Face parameter names)",
    "device": "1x NVIDIA V100 16GB (DGX-1)",
    "batch_size": 64,
    "precision": "mixed precision (FP16)",
    "samples_per_s": 360.4,
    "source": ("Derived, approximate: NVIDIA DeepLearningExamples, TensorFlow2/LanguageModeling/BERT/README.md, "
               "'Fine-tuning inference performance for SQuAD v1.1 on NVIDIA DGX-1 V100 (1x V100 16GB)', BERT-Base "
               "FP16, sequence 128, batch 8: 1081.17 sentences/s (TensorFlow 21.02-py3). Training is taken as 3x "
               "the forward pass (backward = 2x forward): 1081.17 / 3 = 360.4 sequences/s."),
    "source_is_exact": False,
    "note": ("No BERT-base training throughput on one V100 is published in that README (its training tables are "
             "BERT-large); this is the forward figure x3, a common rule that ignores the optimizer and is "
             "pessimistic for batch 64 (batch 8 runs the GPU less efficiently). Per-layer split by FLOPs."),
}


def bench_meta(name: str, step_ms: float) -> dict:
    from .common import MODELS  # noqa: PLC0415

    return {
        "name": name,
        "model": f"aiacc.bench's {name!r} ({MODELS[name]})",
        "device": "the development machine's CPU (2-core VM), torch, one thread",
        "batch_size": 32,
        "precision": "fp32",
        "samples_per_s": round(32 * 1e3 / step_ms, 3),
        "source": ("measured: aiacc.bench.replay_profiles.measure_cpu_step_ms (real model, forward + backward + "
                   f"SGD step, median of 20): {step_ms:.2f} ms per step of 32 samples"),
        "source_is_exact": True,
        "note": "No GPU figure exists for this model; its replay mirrors `bench train` without the CPU contention.",
    }


def write_all(out_dir: str = PROFILE_DIR, bench_models: bool = True) -> List[str]:
    os.makedirs(out_dir, exist_ok=True)
    profiles = [finish(RESNET50_V100, resnet50_layers()), finish(BERT_BASE_V100, bert_base_layers())]
    if bench_models:
        for name in ("cnn", "transformer"):
            profiles.append(finish(bench_meta(name, measure_cpu_step_ms(name)), bench_model_layers(name)))
    written = []
    for prof in profiles:
        path = os.path.join(out_dir, prof["name"] + ".json")
        with open(path, "w") as f:
            json.dump(prof, f, indent=1)
            f.write("\n")
        written.append(path)
    return written


if __name__ == "__main__":
    for p in write_all(bench_models="--no-bench-models" not in sys.argv):
        print(p)
