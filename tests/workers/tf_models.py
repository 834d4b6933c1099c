"""The small Keras layers the TensorFlow presence workers train (built on every rank from the same seed)."""

import keras


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
