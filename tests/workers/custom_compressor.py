"""Horovod's compressors of one's own (a ``Compressor`` subclass: ``compress(t) -> (t, ctx)``,
``decompress(t, ctx)``), 2 or more ranks, torch and TensorFlow.

* Horovod's names import from ``aiacc.torch.compression``, ``aiacc.tensorflow.compression`` and
  ``aiacc.mxnet.compression`` (``Compressor``, ``NoneCompressor``, ``FP16Compressor``, ``BF16Compressor``).
* ``allreduce``, ``grouped_allreduce``, ``reducescatter`` and ``grouped_reducescatter`` apply one as Horovod's
  do: compress, reduce, decompress (the reducescatters refused it before). The
  compressor here quantizes to quarter steps in int16, so the result is the sum of the ranks' quantized values
  (not of the values): eagerly, in ``tf.function``, and with autograd through a differentiable one.
* Where gradients travel in the engine's buckets (torch ``DistributedOptimizer``, ``DistributedGradientTape``)
  it is refused, naming the class and what to use (before: the built-in names did not import, and the
  message did not say why).
"""

import numpy as np

np.bool = bool  # (MXNet 1.9 needs it)
import tensorflow as tf  # noqa: E402
import torch  # noqa: E402

import aiacc.mxnet.compression as mx_compression  # noqa: E402
import aiacc.tensorflow as htf  # noqa: E402
import aiacc.torch as hvd  # noqa: E402
from aiacc.tensorflow.compression import Compressor as TFCompressor  # noqa: E402
from aiacc.torch.compression import BF16Compressor, Compressor, FP16Compressor, NoneCompressor  # noqa: E402
from report import raises, say  # noqa: E402

hvd.init()
r, n = hvd.rank(), hvd.size()
checks = 0
assert TFCompressor is Compressor and mx_compression.Compressor is Compressor
assert (NoneCompressor.name, FP16Compressor.name, BF16Compressor.name) == ("none", "fp16", "bf16")
assert mx_compression.FP16Compressor.name == "fp16"
got = hvd.allreduce(torch.full((3,), 1.0 + r / 3), compression=FP16Compressor, name="builtin")
mean = 1 + (n - 1) / 6  # of 1 + k / 3 over the ranks
assert torch.equal(got.half().float(), got) and torch.allclose(got, torch.full((3,), mean), atol=1e-3), got
checks += 1


class Quarters(Compressor):  # quarter steps as int16
    @staticmethod
    def compress(t):
        return (t * 4).round().to(torch.int16), t.dtype

    @staticmethod
    def decompress(t, ctx):
        return t.to(ctx) / 4


def values(k):
    return torch.tensor([0.3, 1.1, -2.0, 0.06]) * (k + 1)


want = sum((values(k) * 4).round() for k in range(n)) / 4  # quantized, then summed
exact = sum(values(k) for k in range(n))
assert not torch.allclose(want, exact, atol=1e-6)  # (the check can tell)
got = hvd.allreduce(values(r), compression=Quarters, op=hvd.Sum, name="quarters")
assert got.dtype == torch.float32 and torch.equal(got, want), (got, want)
a, b = hvd.grouped_allreduce([values(r), 2 * values(r)], compression=Quarters(), op=hvd.Sum, name="quarters.g")
assert torch.equal(a, want) and torch.equal(b, sum((2 * values(k) * 4).round() for k in range(n)) / 4), (a, b)
checks += 2
rows = [values(k).repeat(n, 1) for k in range(n)]  # n rows: rank r keeps row r of the quantized sum
got = hvd.reducescatter(rows[r], compression=Quarters, op=hvd.Sum, name="quarters.rs")
assert got.dtype == torch.float32 and torch.equal(got, want.reshape(1, -1)), (got, want)
a, b = hvd.grouped_reducescatter([rows[r], 2 * rows[r]], compression=Quarters, op=hvd.Sum, name="quarters.grs")
assert torch.equal(a, want.reshape(1, -1)), a
assert torch.equal(b, (sum((2 * values(k) * 4).round() for k in range(n)) / 4).reshape(1, -1)), b
checks += 2


class Doubled(Compressor):  # differentiable: autograd goes through compress and decompress
    @staticmethod
    def compress(t):
        return t.double() * 2, t.dtype

    @staticmethod
    def decompress(t, ctx):
        return (t / 2).to(ctx)


x = values(r).requires_grad_()
y = hvd.allreduce(x, compression=Doubled, name="doubled")  # Average
(y * torch.arange(4.0)).sum().backward()
assert torch.allclose(y.detach(), exact / n) and torch.allclose(x.grad, torch.arange(4.0)), (y, x.grad)
checks += 1

model = torch.nn.Linear(2, 1)
raises(ValueError, lambda: hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                                    named_parameters=model.named_parameters(), compression=Quarters),
       "Quarters", "a compressor of your own", "Compression.none, .fp16 or .bf16")
checks += 1


class TFQuarters(TFCompressor):
    @staticmethod
    def compress(t):
        return tf.cast(tf.round(t * 4), tf.int32), t.dtype

    @staticmethod
    def decompress(t, ctx):
        return tf.cast(t, ctx) / 4


v = tf.constant(values(r).numpy())
got = htf.allreduce(v, compression=TFQuarters, op=htf.Sum, name="tf.quarters")
assert got.dtype == tf.float32 and np.array_equal(got.numpy(), want.numpy()), got
got = tf.function(lambda t: htf.allreduce(t, compression=TFQuarters, op=htf.Sum, name="tf.quarters.fn"))(v)
assert np.array_equal(got.numpy(), want.numpy()), got
(got,) = htf.grouped_allreduce([v], compression=TFQuarters, op=htf.Sum, name="tf.quarters.g")
assert np.array_equal(got.numpy(), want.numpy()), got
checks += 3
t_rows = tf.constant(rows[r].numpy())
got = htf.reducescatter(t_rows, compression=TFQuarters, op=htf.Sum, name="tf.quarters.rs")
assert got.dtype == tf.float32 and np.array_equal(got.numpy(), want.reshape(1, -1).numpy()), got
got = tf.function(lambda t: htf.grouped_reducescatter([t], compression=TFQuarters, op=htf.Sum,
                                                      name="tf.quarters.grs"))(t_rows)
assert np.array_equal(got[0].numpy(), want.reshape(1, -1).numpy()), got
checks += 2
w = tf.Variable([1.0, 2.0])
with tf.GradientTape() as tape:
    loss = tf.reduce_sum(w * w)
raises(ValueError, lambda: htf.DistributedGradientTape(tape, compression=TFQuarters), "TFQuarters",
       "a compressor of your own")
checks += 1
hvd.shutdown()
say(f"OK rank={r} checks={checks}")
