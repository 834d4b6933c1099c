"""aiacc.keras on Keras' PyTorch backend: gradients go to the buckets during backward(), 2 ranks (KERAS_BACKEND=torch,
AIACC_BUCKET_CAP small enough for a few buckets).

Every case trains a model of several layers, each rank on its half of every global batch, and ends with the
weights of plain Keras (same backend) trained on the whole batches in one process:

* ``model.fit``: from the second step on, a bucket has gone to the engine before autograd has made the step's last
  gradient (a hook of the test's own, registered first, reads the buckets' submit count there), every bucket goes
  exactly once per step and nothing else is reduced (the engine's request count);
* op=Sum, fp16 compression with gradient_predivide_factor, mixed_float16 (compile's LossScaleOptimizer: still
  through the buckets, no second reduction);
* gradients apply() gets that are not the ones backward handed over (changed in place after backward; a second
  backward pass before apply(); torch.autograd.grad's): every rank reduces what apply() got, never the buckets'
  stale data and never twice; after 3 such steps the hooks stop (a warning), results still equal;
* a layer no rank uses on some steps stays untouched there (None: no momentum step), as in one process; a variable
  one rank has no gradient for counts as zeros there (it was a TensorMismatchError);
* a backward pass after training that no apply() follows, then training on; a second DistributedOptimizer over the
  same variables takes their hooks over.
"""

import os
import warnings

import numpy as np
import torch

torch.set_num_threads(1)

import keras  # noqa: E402

import aiacc  # noqa: E402
import aiacc.keras as hvd  # noqa: E402
from report import say  # noqa: E402

assert keras.backend.backend() == "torch" and os.environ.get("AIACC_BUCKET_CAP"), "run with KERAS_BACKEND=torch"
hvd.init()
r, n = hvd.rank(), hvd.size()
assert n == 2, "this worker is written for 2 ranks"
engine = aiacc.get_engine()
checks = 0

rng = np.random.default_rng(5)
features = rng.normal(size=(48, 8)).astype(np.float32)
targets = rng.normal(size=(48, 4)).astype(np.float32)
BATCH = 8  # per rank: each global batch of 16 is split in two halves, one per rank
STEPS = len(features) // (2 * BATCH)
mine = np.concatenate([np.arange(16 * b + BATCH * r, 16 * b + BATCH * (r + 1)) for b in range(STEPS)])


def model_of(seed=3):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"),
                             keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(16, activation="tanh"),
                             keras.layers.Dense(4)])


def weights(model):
    return [keras.ops.convert_to_numpy(w).astype(np.float32) for w in model.trainable_weights]


def same(model, ref, what, tol=1e-5):
    for w, v in zip(weights(model), weights(ref)):
        assert np.allclose(w, v, rtol=tol, atol=tol), (what, w.shape, np.abs(w - v).max())


def reference(lr=0.1, momentum=0.9, **fit):
    ref = model_of()
    ref.compile(optimizer=keras.optimizers.SGD(lr, momentum=momentum), loss="mse")
    ref.fit(features, targets, batch_size=2 * BATCH, shuffle=False, verbose=0, **fit)
    return ref


def requests() -> int:
    return engine.summary()["allreduce_requests"]


def buckets_of(opt):
    return opt._aiacc_reducer.buckets


# ---- fit: buckets go during backward ------------------------------------------------------------------------
model = model_of()
params = [v.value for v in model.trainable_weights]
seen = []  # per gradient made: (the step, the variable, bucket requests submitted before it was handed over)
opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), name="overlap")
for k, p in enumerate(params):  # registered before the optimizer's hooks: they run first
    p.register_post_accumulate_grad_hook(lambda _p, k=k: seen.append((len(seen) // len(params), k, submits())))


def submits() -> int:
    tb = opt._aiacc_reducer.buckets
    return tb.buckets.submits if tb is not None else 0


model.compile(optimizer=opt, loss="mse")
before = requests()
model.fit(features[mine], targets[mine], batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
made = requests() - before
same(model, reference(epochs=2), "fit")
tb = buckets_of(opt)
nb = len(tb.buckets.buckets)
assert nb >= 3 and tb.redo_count == 0 and tb.on, (nb, tb.buckets.describe(), tb.redo_count)
steps = 2 * STEPS
assert len(seen) == steps * len(params), seen
for step in range(1, steps):  # (the first step settles the buckets in apply)
    mark = seen[step * len(params)][2]
    last = seen[(step + 1) * len(params) - 1]
    assert last[1] == 0, ("the first layer's kernel is not the step's last gradient", seen[step * len(params):])
    # every bucket but the one that fills last (held back for apply's flags) had gone before it
    assert last[2] - mark == nb - 1, f"step {step}: {last[2] - mark} of {nb} buckets submitted before the last " \
        f"gradient was made: {seen}"
assert submits() == steps * nb, (submits(), steps, nb)
# every bucket once per step, and nothing else: the first step's agreement on the buckets (2 requests)
assert made == 2 + steps * nb, f"{made} allreduce requests for {steps} steps of {nb} buckets"
checks += 3

# ---- op=Sum, fp16 on the wire with a predivide factor -----------------------------------------------------------
for what, kwargs, lr, tol in [("op=Sum", dict(op=hvd.Sum), 0.05, 1e-5),
                              ("fp16", dict(compression=hvd.Compression.fp16, gradient_predivide_factor=2.0), 0.1, 2e-3)]:
    model = model_of()
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(lr, momentum=0.9), name=f"overlap.{what}", **kwargs)
    model.compile(optimizer=opt, loss="mse")
    model.fit(features[mine], targets[mine], batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    same(model, reference(), what, tol)
    assert buckets_of(opt).redo_count == 0 and buckets_of(opt).buckets.submits == STEPS * nb, what
    checks += 1

# ---- mixed_float16: compile's LossScaleOptimizer around the DistributedOptimizer, through the buckets -----------
keras.mixed_precision.set_global_policy("mixed_float16")
model = model_of()
opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), name="overlap.mixed")
model.compile(optimizer=opt, loss="mse")
assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer), type(model.optimizer)
before = requests()
model.fit(features[mine], targets[mine], batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
made = requests() - before
ref = reference()
keras.mixed_precision.set_global_policy("float32")
same(model, ref, "mixed_float16", 2e-3)
assert buckets_of(opt).redo_count == 0 and made == 2 + STEPS * nb, (buckets_of(opt).redo_count, made)
checks += 1


# ---- a custom loop: what apply() gets is not what backward handed over ---------------------------------------------
def mse(model, x, y):
    return torch.mean((model(torch.from_numpy(x)) - torch.from_numpy(y)) ** 2)


def custom_loop(opt, x, y, epochs, how):
    model = model_of()
    for _ in range(epochs):
        for b in range(STEPS):
            xb, yb = x[b * len(x) // STEPS:(b + 1) * len(x) // STEPS], y[b * len(y) // STEPS:(b + 1) * len(y) // STEPS]
            model.zero_grad()
            if how == "second backward":  # a backward pass that is not the step's (a gradient penalty's probe, ...)
                (3.0 * mse(model, xb, yb)).backward()
                model.zero_grad()
            if how == "autograd.grad":
                grads = list(torch.autograd.grad(mse(model, xb, yb), [v.value for v in model.trainable_weights]))
            else:
                mse(model, xb, yb).backward()
                grads = [v.value.grad for v in model.trainable_weights]
            if how == "scaled in place":
                for g in grads:
                    g.mul_(2.0)
            with torch.no_grad():
                opt.apply(grads, model.trainable_weights)
    return model


for how, lr, redos in [("scaled in place", 0.05, 3), ("second backward", 0.1, 3), ("autograd.grad", 0.1, 0)]:
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(lr, momentum=0.9), name=f"loop.{how}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = custom_loop(opt, features[mine], targets[mine], 3, how)
    ref = custom_loop(keras.optimizers.SGD(0.1, momentum=0.9), features, targets, 3, "plain")
    same(model, ref, how)
    tb = buckets_of(opt)
    # the first apply builds the optimizer and settles the buckets: hooks from step 2 on
    assert tb.redo_count == redos and tb.on == (redos == 0), (how, tb.redo_count, tb.on)
    said = [str(w.message) for w in caught if "without overlapping backward" in str(w.message)]
    assert len(said) == (1 if redos and r == 0 else 0), (how, said)
    checks += 1

# ---- None gradients: on every rank (the layer is left alone), on one rank (zeros there) -----------------------------
def skipping(opt, rows, steps):
    """Odd steps train without the third layer (its output replaced by its input): it gets no gradient there.
    ``rows(s)``: the rows of step s."""
    model = model_of()
    for s in range(steps):
        model.zero_grad()
        h = torch.from_numpy(features[rows(s)])
        for k, layer in enumerate(model.layers):
            h = h if (k == 2 and s % 2) else layer(h)
        torch.mean((h - torch.from_numpy(targets[rows(s)])) ** 2).backward()
        grads = [v.value.grad for v in model.trainable_weights]
        assert (grads[4] is None) == bool(s % 2), (s, grads[4])
        with torch.no_grad():
            opt.apply(grads, model.trainable_weights)
    return model


opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), name="none.everywhere")
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", "Gradients do not exist")  # (Keras' word on the None)
    model = skipping(opt, lambda s: np.arange(16 * (s % STEPS) + BATCH * r, 16 * (s % STEPS) + BATCH * (r + 1)), 6)
    ref = skipping(keras.optimizers.SGD(0.1, momentum=0.9), lambda s: np.arange(16 * (s % STEPS), 16 * (s % STEPS) + 16),
                   6)
same(model, ref, "None on every rank")
assert buckets_of(opt).redo_count == 0
checks += 1

a, b = keras.Variable(np.zeros(3, np.float32)), keras.Variable(np.zeros(2, np.float32))
opt = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0), name="none.somewhere")
x = torch.tensor([1.0 + r, 2.0, 3.0])
for step in range(4):  # (hooks from the second step on)
    for v in (a, b):
        v.value.grad = None
    loss = torch.sum(a.value * x) + (torch.sum(b.value * torch.tensor([4.0, 5.0])) if r == 0 else 0.0)
    loss.backward()
    with torch.no_grad():
        opt.apply([a.value.grad, b.value.grad], [a, b])
    k = step + 1
    assert np.allclose(keras.ops.convert_to_numpy(a), -k * np.array([1.5, 2.0, 3.0])), (step, a)
    assert np.allclose(keras.ops.convert_to_numpy(b), -k * np.array([2.0, 2.5])), (step, b)  # (rank 1: zeros)
assert buckets_of(opt).redo_count == 0
checks += 1

# ---- a backward pass no apply() follows, then training goes on; a second optimizer over the same variables ----------
model = model_of()
opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), name="after")
model.compile(optimizer=opt, loss="mse")
model.fit(features[mine], targets[mine], batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
mse(model, features[mine], targets[mine]).backward()  # (its buckets go to the engine, never to an update)
model.fit(features[mine], targets[mine], batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
same(model, reference(epochs=2), "a backward pass between two fits")
assert buckets_of(opt).redo_count == 1, buckets_of(opt).redo_count  # (the first step after it)
old = buckets_of(opt)
sent = old.buckets.submits
newer = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), name="after.newer")
model.compile(optimizer=newer, loss="mse")
model.fit(features[mine], targets[mine], batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
assert old.buckets.submits == sent and buckets_of(newer).buckets.submits == STEPS * nb, \
    (old.buckets.submits, sent, buckets_of(newer).buckets.submits)
checks += 2

say(f"OK rank={r} checks={checks}")
