"""Training patterns of real users on TensorFlow 2 / Keras 3 (TensorFlow backend), each against one process
training on the whole global batch (both ranks' rows of every step), to float rounding:

custom loop with DistributedGradientTape (eagerly and in tf.function):
- a layer not called on some steps, on every rank (its gradients None; the first step among them): Adam and SGD
  with momentum leave it as one process does (None stays None, so Keras skips it; zeros would step it);
- a layer frozen mid-training (gradients over ``trainable_variables``, which shrinks) and unfrozen later;
- a GAN: two tapes per step in tf.function, one persistent tape asked twice eagerly;
- ``tf.clip_by_global_norm`` on the averaged gradients; a dict of variables as sources;
- ``unconnected_gradients=tf.UnconnectedGradients.ZERO`` over a Keras model's variables (it failed: TensorFlow
  makes the zeros of a source's dtype, which a Keras variable gives as a string); with it, a layer called on
  rank 0 only gets the average of rank 0's gradient and rank 1's zeros (one process with the layer's output
  masked off rank 1's rows);
model.fit with DistributedOptimizer:
- a layer not called in ``call()`` in some phases (recompiled), Adam; a layer frozen and unfrozen (recompiled),
  SGD with momentum and gradient accumulation;
- ``clipnorm`` and ``global_clipnorm`` (Keras clips in ``apply``, after aiacc averaged: the whole batch's
  gradient is clipped, as in one process);
- a subclassed keras.Model whose ``train_step`` trains a GAN with two DistributedOptimizers.
"""

import numpy as np
import tensorflow as tf

tf.get_logger().setLevel("ERROR")

import warnings  # noqa: E402

import keras  # noqa: E402

import aiacc.tensorflow as hvd  # noqa: E402
import aiacc.tensorflow.keras as hvd_keras  # noqa: E402
from one_process import Checks  # noqa: E402
from report import say  # noqa: E402
from tf_models import dense_heads  # noqa: E402

warnings.filterwarnings("ignore", message="Gradients do not exist")  # Keras' warning for the skipped layer
hvd.init()
r, n = hvd.rank(), hvd.size()
PART, STEPS = 4, 5
B = PART * n
mine = slice(r * PART, (r + 1) * PART)
rng = np.random.default_rng(0)
X = rng.normal(size=(STEPS, B, 5)).astype(np.float32)
Y = rng.normal(size=(STEPS, B, 1)).astype(np.float32)
checks = Checks()


same = checks.close


def tape_loop(pattern, optimizer, dist, traced):
    a, b, c = dense_heads()
    opt = optimizer()
    every = a.trainable_variables + b.trainable_variables + c.trainable_variables

    def step(x, y, use_c):
        with tf.GradientTape() as tape:
            h = a(x)
            if pattern == "one rank" and not dist:  # c on rank 0's rows only: the average of the ranks' gradients
                out = b(h) + c(h) * tf.constant(np.arange(B)[:, None] < PART, tf.float32)
            else:
                out = b(h) + c(h) if use_c else b(h)
            loss = tf.reduce_mean((out - y) ** 2)
        if dist:
            tape = hvd.DistributedGradientTape(tape)
        if pattern == "freeze":
            sources = [v for L in (a, b, c) for v in L.trainable_variables]
            opt.apply_gradients(zip(tape.gradient(loss, sources), sources))
            return
        if pattern == "dict":
            got = tape.gradient(loss, {"a": a.trainable_variables, "b": b.trainable_variables,
                                       "c": c.trainable_variables})
            grads = got["a"] + got["b"] + got["c"]
        elif pattern in ("zero", "one rank"):  # (plain TensorFlow needs the tf.Variables: .value)
            grads = tape.gradient(loss, every if dist else [v.value for v in every],
                                  unconnected_gradients=tf.UnconnectedGradients.ZERO)
        else:
            grads = tape.gradient(loss, every)
        if pattern == "clip":
            grads, _ = tf.clip_by_global_norm(grads, 0.05)
        opt.apply_gradients(zip(grads, every))

    fn = tf.function(step) if traced else step
    for k in range(STEPS):
        if pattern == "freeze" and a.trainable == (2 <= k < 4):
            a.trainable = not (2 <= k < 4)
            fn = tf.function(step) if traced else step  # (a traced function keeps the list it was traced with)
        x, y = (X[k][mine], Y[k][mine]) if dist else (X[k], Y[k])
        use_c = {"skip": k % 3 == 1, "zero": k % 3 == 1, "one rank": r == 0}.get(pattern, True)
        fn(tf.constant(x), tf.constant(y), use_c)
    a.trainable = True
    return every


def adam():
    return keras.optimizers.Adam(0.05)


def momentum():
    return keras.optimizers.SGD(0.05, momentum=0.9)


for pattern, optimizer, traced in [("skip", adam, False), ("skip", momentum, True), ("freeze", momentum, False),
                                   ("freeze", adam, True), ("clip", momentum, True), ("dict", adam, False),
                                   ("zero", adam, True), ("zero", momentum, False), ("one rank", adam, False),
                                   ("one rank", momentum, True)]:
    same(f"tape {pattern} traced={traced}", tape_loop(pattern, optimizer, False, traced),
         tape_loop(pattern, optimizer, True, traced))

bce = keras.losses.BinaryCrossentropy(from_logits=True)


def gan_models():
    keras.utils.set_random_seed(3)
    G = keras.Sequential([keras.Input((3,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(4)])
    D = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])
    return G, D


def d_loss(D, real, fake):
    return bce(tf.ones_like(D(real)), D(real)) + bce(tf.zeros_like(D(fake)), D(fake))


def gan_loop(persistent, dist, traced):
    G, D = gan_models()
    og, od = keras.optimizers.Adam(0.01), keras.optimizers.SGD(0.05, momentum=0.9)

    def step(z, real):
        if persistent:
            with tf.GradientTape(persistent=True) as t:
                fake = G(z)
                ld, lg = d_loss(D, real, fake), bce(tf.ones_like(D(fake)), D(fake))
            if dist:
                t = hvd.DistributedGradientTape(t)
            gd, gg = t.gradient(ld, D.trainable_variables), t.gradient(lg, G.trainable_variables)
        else:
            with tf.GradientTape() as td:
                ld = d_loss(D, real, G(z))
            if dist:
                td = hvd.DistributedGradientTape(td)
            gd = td.gradient(ld, D.trainable_variables)
            od.apply_gradients(zip(gd, D.trainable_variables))
            with tf.GradientTape() as tg:
                lg = bce(tf.ones_like(D(G(z))), D(G(z)))
            if dist:
                tg = hvd.DistributedGradientTape(tg)
            gg = tg.gradient(lg, G.trainable_variables)
        if persistent:
            od.apply_gradients(zip(gd, D.trainable_variables))
        og.apply_gradients(zip(gg, G.trainable_variables))

    fn = tf.function(step) if traced else step
    for k in range(STEPS):
        z, real = (X[k][mine, :3], X[k][mine, 1:]) if dist else (X[k][:, :3], X[k][:, 1:])
        fn(tf.constant(z), tf.constant(real))
    return G.weights + D.weights


same("tape GAN, two tapes, traced", gan_loop(False, False, True), gan_loop(False, True, True))
same("tape GAN, persistent tape, eager", gan_loop(True, False, False), gan_loop(True, True, False))

# ---- model.fit ---------------------------------------------------------------------------------------------------
rows = np.concatenate([np.arange(k * B + r * PART, k * B + (r + 1) * PART) for k in range(STEPS)])  # this rank's
FX, FY = X.reshape(-1, 5), Y.reshape(-1, 1)


class ThreeLayers(keras.Model):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(1), keras.layers.Dense(1)
        self.use_c = True

    def call(self, x):
        h = self.a(x)
        return self.b(h) + self.c(h) if self.use_c else self.b(h)


def fit(pattern, optimizer, dist):
    keras.utils.set_random_seed(1)
    m = ThreeLayers()
    m(FX[:1])
    opt = hvd_keras.DistributedOptimizer(optimizer()) if dist else optimizer()
    x, y = (FX[rows], FY[rows]) if dist else (FX, FY)
    phases = {"skip": [dict(use_c=False), dict(use_c=True), dict(use_c=False)],
              "freeze": [dict(), dict(frozen=True), dict()]}.get(pattern, [dict()])
    for phase in phases:
        m.use_c = phase.get("use_c", True)
        m.a.trainable = not phase.get("frozen", False)
        m.compile(optimizer=opt, loss="mse")
        m.fit(x, y, batch_size=PART if dist else B, epochs=1, shuffle=False, verbose=0)
    m.a.trainable = True
    return m.weights


for pattern, optimizer in [("skip", adam),
                           ("freeze", lambda: keras.optimizers.SGD(0.05, momentum=0.9, gradient_accumulation_steps=2)),
                           ("clip", lambda: keras.optimizers.SGD(0.5, clipnorm=0.02)),
                           ("clip", lambda: keras.optimizers.SGD(0.5, global_clipnorm=0.05))]:
    same(f"fit {pattern}", fit(pattern, optimizer, False), fit(pattern, optimizer, True))


class GAN(keras.Model):
    def __init__(self):
        super().__init__()
        self.G, self.D = gan_models()

    def compile(self, og, od):
        super().compile()
        self.og, self.od = og, od

    def train_step(self, data):
        z, real = data[:, :3], data[:, 1:]
        with tf.GradientTape() as td:
            ld = d_loss(self.D, real, self.G(z))
        self.od.apply_gradients(zip(td.gradient(ld, self.D.trainable_variables), self.D.trainable_variables))
        with tf.GradientTape() as tg:
            lg = bce(tf.ones_like(self.D(self.G(z))), self.D(self.G(z)))
        self.og.apply_gradients(zip(tg.gradient(lg, self.G.trainable_variables), self.G.trainable_variables))
        return {"d": ld, "g": lg}


def fit_gan(dist):
    m = GAN()
    og, od = keras.optimizers.Adam(0.01), keras.optimizers.SGD(0.05, momentum=0.9)
    if dist:
        og, od = hvd_keras.DistributedOptimizer(og, name="g"), hvd_keras.DistributedOptimizer(od, name="d")
    m.compile(og, od)
    m.fit(FX[rows] if dist else FX, batch_size=PART if dist else B, epochs=2, shuffle=False, verbose=0)
    return m.G.weights + m.D.weights


same("fit GAN, two DistributedOptimizers in train_step", fit_gan(False), fit_gan(True))

say(f"OK rank={r} checks={checks.count}")
hvd.shutdown()
