"""A SavedModel whose function calls an aiacc collective, loaded in another process.

TensorFlow keeps such an op (a ``numpy_function``) as a key into the registry of the process that traced
it; another process maps that key to whatever it registered under it. Usage:
  tf_savedmodel.py save DIR   traces and saves ``avg(x) = hvd.allreduce(x)`` (one rank)
  tf_savedmodel.py load DIR   traces a different aiacc function first (it takes the same key here), then
                              loads DIR and calls ``avg``: an error naming the cause, never the other
                              function's result (3 x the sum, which it gave before)
"""

import sys

import tensorflow as tf

import aiacc.tensorflow as hvd
from report import say

mode, where = sys.argv[1], sys.argv[2]
hvd.init()
spec = [tf.TensorSpec([2], tf.float32)]
if mode == "save":
    class Averager(tf.Module):
        @tf.function(input_signature=spec)
        def avg(self, x):
            return hvd.allreduce(x, op=hvd.Average, name="avg")

    module = Averager()
    assert module.avg(tf.constant([1.0, 2.0])).numpy().tolist() == [1.0, 2.0]
    tf.saved_model.save(module, where)
    say(f"SAVED rank={hvd.rank()}")
else:
    for k in range(4):  # (the saved op's key is one of the first few: each of these takes one)
        @tf.function(input_signature=spec)
        def other(x, k=k):
            return hvd.allreduce(x, op=hvd.Sum, prescale_factor=3.0, name=f"other{k}")

        assert other(tf.constant([1.0, 2.0])).numpy().tolist() == [3.0, 6.0]
    loaded = tf.saved_model.load(where)
    try:
        result = loaded.avg(tf.constant([1.0, 2.0])).numpy().tolist()
    except Exception as exc:  # noqa: BLE001 - the message is the check
        say(f"ERROR-SEEN rank={hvd.rank()}: {exc}")
    else:
        say(f"RESULT rank={hvd.rank()}: {result}")
