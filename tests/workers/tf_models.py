"""The small Keras layers the TensorFlow presence workers train (built on every rank from the same seed)."""

import keras
import tensorflow as tf


def dense_heads():
    """A shared Dense(4) feeding two Dense(1) heads (tf_presence.py, tf_patterns.py): (a, b, c)."""
    keras.utils.set_random_seed(1)
    a, b, c = keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(1), keras.layers.Dense(1)
    x = keras.Input((5,))
    b(a(x)), c(a(x))
    return a, b, c


def embedding_dense():
    """An Embedding(6, 2) of 2 ids and a Dense(1) over 3 features (tf_presence_later.py, tf_kinds.py): (emb, dense)."""
    keras.utils.set_random_seed(1)
    emb, dense = keras.layers.Embedding(6, 2), keras.layers.Dense(1)
    emb.build((None, 2))
    dense.build((None, 3))
    return emb, dense


def lookup(emb, ids, kind):
    """The rows ``ids`` of the table, summed per sample: IndexedSlices gradient (s) or dense (d); None (-)."""
    if kind == "s":
        return tf.reduce_sum(emb(ids), axis=[1, 2])[:, None]
    if kind == "d":
        return tf.reduce_sum(tf.matmul(tf.one_hot(ids, 6), emb.embeddings), axis=[1, 2])[:, None]
    return None


def kinds_output(emb, dense, x, ids, kinds, dist, rank, part):
    """dense(x) plus the looked-up rows (tf_kinds.py, tf_kinds_first.py); ``kinds[k]``: how rank k looks them up,
    ``part`` rows each (one process: each rank's rows so)."""
    out = dense(x)
    if dist:
        term = lookup(emb, ids, kinds[rank])
        return out if term is None else out + term
    terms = [lookup(emb, ids[k * part:(k + 1) * part], kind) for k, kind in enumerate(kinds)]
    if all(t is None for t in terms):
        return out
    return out + tf.concat([tf.zeros([part, 1]) if t is None else t for t in terms], 0)
