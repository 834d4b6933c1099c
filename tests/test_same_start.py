"""The optimizer wrappers' one-time check that the ranks start training from the same parameters (a forgotten
broadcast: each rank silently trains its own model): a warning on every rank naming the parameters, the ranks and the
call to add; none when the script broadcasts (before or after the first step), nor with AIACC_CHECK_SAME_START=0; and
no collective added to any step but the second."""

import ast
import os
import re
import shutil
import sys
import sysconfig
from pathlib import Path

import pytest

from conftest import WORKERS, aiaccrun, assert_ok, need_framework, run


def _warned(job, rank):
    return re.findall(rf"WARNED rank={rank} .*", job.output)


def _counts(job, rank):
    """The collectives run by each step after the first (steps 2, 3, ...)."""
    found = re.search(rf"COUNTS rank={rank} (\[[0-9, ]*\])", job.output)
    assert found, job.output
    return ast.literal_eval(found.group(1))


def _check_warned(job, expected: bool, *words):
    """Each of the 2 ranks warned once, its warning holding every one of ``words``, when ``expected``; else none."""
    for r in range(2):
        warned = _warned(job, r)
        assert len(warned) == expected, job.output
        for w in words if expected else ():
            assert w in warned[0], (w, warned[0])


def _check_counts(job, ranks, extra):
    """The second step ran ``extra`` collectives more than every later one, which all ran the same number."""
    for r in ranks:
        second, *later = _counts(job, r)
        assert len(set(later)) == 1 and second == later[0] + extra, (r, second, later, job.output)


class TestTorch:
    @pytest.fixture(autouse=True)
    def _torch(self):
        need_framework("torch")

    def test_forgotten_broadcast_warns_on_every_rank_naming_parameters_ranks_and_the_fix(self):
        job = aiaccrun(2, "same_start_torch.py", "0", "average", "1", "0", "all", timeout=120)
        assert_ok(job, 2)
        for r in range(2):
            warned = _warned(job, r)
            assert len(warned) == 1, job.output  # once, not at every step
            text = warned[0]
            assert "UserWarning same_start_torch.py:" in text  # (pointing at the script's opt.step())
            for words in ("'0.weight', '0.bias', '2.weight', '2.bias' (4 of 4) on rank 1 are not those of rank 0",
                          "hvd.broadcast_parameters(model.state_dict(), root_rank=0)",
                          "AIACC_CHECK_SAME_START=0 switches this check off"):
                assert words in text, (words, text)
        _check_counts(job, range(2), extra=2)  # the comparison and, as they differ, the gather naming the ranks

    @pytest.mark.parametrize("op,passes,overlap", [("average", 1, "0"), ("sum", 2, "0"), ("average", 1, "1"),
                                                   ("adasum", 1, "0")])
    def test_broadcast_parameters_means_no_warning_and_one_collective_once(self, op, passes, overlap):
        job = aiaccrun(2, "same_start_torch.py", "1", op, str(passes), overlap, "all", timeout=120)
        assert_ok(job, 2)
        assert not _warned(job, 0) and not _warned(job, 1), job.output
        if overlap == "0":  # (with overlap_forward a step's allreduce completes in the next one: counts shift)
            _check_counts(job, range(2), extra=1)

    def test_overlap_forward_without_broadcast_warns_too(self):
        job = aiaccrun(2, "same_start_torch.py", "0", "average", "1", "1", "all", timeout=120)
        assert_ok(job, 2)
        assert len(_warned(job, 0)) == 1 and len(_warned(job, 1)) == 1, job.output

    def test_switched_off_by_the_variable_no_warning_and_no_collective(self):
        job = aiaccrun(2, "same_start_torch.py", "0", "average", "1", "0", "all", timeout=120,
                       env={"AIACC_CHECK_SAME_START": "0"})
        assert_ok(job, 2)
        assert not _warned(job, 0) and not _warned(job, 1), job.output
        _check_counts(job, range(2), extra=0)

    def test_compares_within_the_optimizers_process_set_only(self):
        # rank 1 starts from other values, but it is outside the set {0, 2}, whose ranks agree
        job = aiaccrun(3, "same_start_torch.py", "0", "average", "1", "0", "0,2", timeout=120)
        assert_ok(job, 3)
        assert not any(_warned(job, r) for r in range(3)), job.output


class TestMXNet:
    @pytest.fixture(autouse=True)
    def _mxnet(self):
        need_framework("mxnet")

    def test_forgotten_broadcast_warns_naming_parameters_but_not_batchnorm_statistics(self):
        job = aiaccrun(2, "same_start_mx.py", "0", timeout=120)
        assert_ok(job, 2)
        for r in range(2):
            warned = _warned(job, r)
            assert len(warned) == 1, job.output
            assert "UserWarning same_start_mx.py:" in warned[0], warned[0]
            for words in ("DistributedTrainer: the ranks do not train the same model", "on rank 1 are not those of "
                          "rank 0", "hvd.broadcast_parameters(net.collect_params(), root_rank=0)",
                          "AIACC_CHECK_SAME_START=0"):
                assert words in warned[0], (words, warned[0])
            assert "weight" in warned[0] and "running_mean" not in warned[0], warned[0]
        _check_counts(job, range(2), extra=2)

    def test_broadcast_parameters_means_no_warning(self):
        job = aiaccrun(2, "same_start_mx.py", "1", timeout=120)
        assert_ok(job, 2)
        assert not _warned(job, 0) and not _warned(job, 1), job.output
        _check_counts(job, range(2), extra=1)

    @pytest.mark.parametrize("broadcast", ["0", "1"])
    def test_distributed_optimizer_in_a_gluon_trainer_checks_at_the_second_steps_first_update(self, broadcast):
        # Horovod's other MXNet recipe (also the Module API's path): gluon.Trainer(..., DistributedOptimizer(opt),
        # kvstore=None); the optimizer sees one update per parameter, the second step's first one is the check
        job = aiaccrun(2, "same_start_mx.py", broadcast, "optimizer", timeout=120)
        assert_ok(job, 2)
        _check_warned(job, broadcast == "0", "UserWarning same_start_mx.py:", "DistributedOptimizer: the ranks do not "
                      "train the same model: the values of parameters 'dense0_weight', 'dense1_weight' (2 of 6) on rank "
                      "1 are not those of rank 0", "hvd.broadcast_parameters(")
        _check_counts(job, range(2), extra=2 if broadcast == "0" else 1)


# Keras 3 on TensorFlow (model.fit traces the step: the check is a tf.cond in the traced apply), the same run eagerly,
# Keras 3 on PyTorch, on JAX (one compiled step: a jax.lax.cond whose branch hands the values to the host) and the
# same run eagerly, Keras 2 (tf_keras, TF_USE_LEGACY_KERAS=1)
_KERAS = {"tf": ({}, ()), "tf-eager": ({}, ("eager",)), "torch": ({"KERAS_BACKEND": "torch"}, ()),
          "jax": ({"KERAS_BACKEND": "jax"}, ()), "jax-eager": ({"KERAS_BACKEND": "jax"}, ("eager",)),
          "keras2": ({"TF_USE_LEGACY_KERAS": "1"}, ())}


def _keras_job(mode, flavour, env=None):
    extra_env, extra_args = _KERAS[flavour]
    need_framework("tensorflow")
    need_framework({"torch": "torch", "jax": "jax", "jax-eager": "jax", "keras2": "tf_keras"}.get(flavour, "keras"))
    return aiaccrun(2, "same_start_keras.py", mode, *extra_args, env={**extra_env, **(env or {})}, timeout=240)


class TestKeras:
    @pytest.mark.parametrize("flavour", list(_KERAS))
    def test_fit_without_broadcast_warns_on_every_rank_naming_the_trainable_variables(self, flavour):
        job = _keras_job("none", flavour)
        assert_ok(job, 2)
        scope = "" if flavour == "keras2" else "sequential/"
        for r in range(2):
            warned = _warned(job, r)
            assert len(warned) == 1, job.output  # once, not at every step
            assert "UserWarning same_start_keras.py:" in warned[0], warned[0]  # (the script's model.fit(...))
            for words in (f"DistributedOptimizer: the ranks do not train the same model: the values of parameters "
                          f"'{scope}hidden/kernel', '{scope}out/kernel' (2 of 6) on rank 1 are not those of rank 0",
                          "hvd.callbacks.BroadcastGlobalVariablesCallback(0)", "AIACC_CHECK_SAME_START=0"):
                assert words in warned[0], (words, warned[0])
            # (6: kernels, biases, BatchNorm's gamma and beta; its moving statistics, which differ, are not compared)
            assert "moving" not in warned[0], warned[0]
        _check_counts(job, range(2), extra=2)  # the comparison and, as they differ, the gather naming the ranks

    @pytest.mark.parametrize("flavour", ["tf", "torch", "jax", "keras2"])
    def test_broadcast_callback_after_the_first_batch_means_no_warning_and_one_collective_once(self, flavour):
        # (the model is built in the first step: the callback broadcasts at the end of the first batch, Horovod's way)
        job = _keras_job("callback", flavour)
        assert_ok(job, 2)
        assert not _warned(job, 0) and not _warned(job, 1), job.output
        _check_counts(job, range(2), extra=1)

    def test_the_callbacks_local_variables_are_not_compared(self):
        # the output kernel stays each rank's own (local_variables of the callback): no warning for it
        job = _keras_job("local", "tf")
        assert_ok(job, 2)
        assert not _warned(job, 0) and not _warned(job, 1), job.output
        _check_counts(job, range(2), extra=1)

    def test_switched_off_by_the_variable_no_warning_and_no_collective(self):
        job = _keras_job("none", "tf", env={"AIACC_CHECK_SAME_START": "0"})
        assert_ok(job, 2)
        assert not _warned(job, 0) and not _warned(job, 1), job.output
        _check_counts(job, range(2), extra=0)


_HOOK, _BROADCAST = "hooks=[hvd.BroadcastGlobalVariablesHook(0)]", "hvd.broadcast_variables(var_list, root_rank=0)"
_TF1_FIX = {"graph": _HOOK, "v1": _HOOK, "tape": _HOOK, "eager": _BROADCAST, "traced": _BROADCAST}


class TestTensorFlow1:
    """TF1's DistributedOptimizer (a TF1 graph run by a Session, TF1's own control flow, eagerly, in tf.function) and
    a DistributedGradientTape in a TF1 graph: counted per run of the graph by a host op, compared in a tf.cond."""

    @pytest.fixture(autouse=True)
    def _tensorflow(self):
        need_framework("tensorflow")

    @pytest.mark.parametrize("mode", list(_TF1_FIX))
    def test_forgotten_broadcast_warns_at_the_second_step_naming_the_variable_not_the_local_one(self, mode):
        job = aiaccrun(2, "same_start_tf1.py", mode, "0", timeout=240)
        assert_ok(job, 2)
        what = "DistributedGradientTape" if mode == "tape" else "DistributedOptimizer"
        # ('w' differs; 'b' does not; 'u' differs but is register_local_var's)
        _check_warned(job, True, f"{what}: the ranks do not train the same model: the values of parameter 'w' (1 of 2) "
                      "on rank 1 are not those of rank 0", _TF1_FIX[mode], "AIACC_CHECK_SAME_START=0")
        # (pointing at the script: eagerly its compute_gradients(), traced or in a graph the line that built the step)
        assert "UserWarning same_start_tf1.py:" in _warned(job, 0)[0], job.output
        _check_counts(job, range(2), extra=2)

    @pytest.mark.parametrize("mode", list(_TF1_FIX))
    def test_broadcast_means_no_warning_one_collective_once_and_the_averaged_sgd(self, mode):
        # (the worker checks the final weights against numpy's SGD of the averaged gradients)
        job = aiaccrun(2, "same_start_tf1.py", mode, "1", timeout=240)
        assert_ok(job, 2)
        _check_warned(job, False)
        _check_counts(job, range(2), extra=1)


class TestTensorFlowTape:
    @pytest.fixture(autouse=True)
    def _tensorflow(self):
        need_framework("tensorflow")

    def test_forgotten_broadcast_warns_at_the_second_gradient_call(self):
        job = aiaccrun(2, "same_start_tape.py", "0", "0", timeout=240)
        assert_ok(job, 2)
        for r in range(2):
            warned = _warned(job, r)
            assert len(warned) == 1, job.output
            assert "UserWarning same_start_tape.py:" in warned[0], warned[0]  # (the script's tape.gradient())
            for words in ("DistributedGradientTape: the ranks do not train the same model: the values of parameters "
                          "'sequential/hidden/kernel', 'sequential/out/kernel' (2 of 4) on rank 1 are not those of "
                          "rank 0", "hvd.broadcast_variables(model.variables, root_rank=0)",
                          "AIACC_CHECK_SAME_START=0"):
                assert words in warned[0], (words, warned[0])
        _check_counts(job, range(2), extra=2)

    def test_horovods_broadcast_after_the_first_step_means_no_warning_and_one_collective_once(self):
        job = aiaccrun(2, "same_start_tape.py", "1", "0", timeout=240)
        assert_ok(job, 2)
        assert not _warned(job, 0) and not _warned(job, 1), job.output
        _check_counts(job, range(2), extra=1)

    @pytest.mark.parametrize("broadcast", ["0", "1"])
    def test_a_traced_gradient_is_checked_in_its_reduction_at_the_second_step(self, broadcast):
        # Horovod's tensorflow2 example: the step in a tf.function, broadcast after the first batch (or forgotten)
        job = aiaccrun(2, "same_start_tape.py", broadcast, "1", timeout=240)
        assert_ok(job, 2)
        _check_warned(job, broadcast == "0", "DistributedGradientTape: the ranks do not train the same model: the "
                      "values of parameters 'sequential/hidden/kernel', 'sequential/out/kernel' (2 of 4) on rank 1 are "
                      "not those of rank 0", "hvd.broadcast_variables(model.variables")
        if broadcast == "0":  # (pointing at the script's line that traced the step, not at aiacc)
            assert "UserWarning same_start_tape.py:" in _warned(job, 0)[0], job.output
        _check_counts(job, range(2), extra=2 if broadcast == "0" else 1)

    @pytest.mark.parametrize("where", ["installed", "local"])
    def test_a_script_run_as_a_packages_module_is_the_line_named(self, where, tmp_path):
        # ``python -m pkg.train``: installed, every frame is an installed package's, yet the warning names the script's
        # line that traced the step (before: aiacc's own line); local or installed, the warning is given without
        # asking pkg.train's loader for the source of ``__main__`` (before: an ImportError that ended the job)
        top = Path(sysconfig.get_paths()["purelib"]) if where == "installed" else tmp_path
        package = top / f"aiacc_test_{where}_{os.getpid()}"
        package.mkdir()
        try:
            (package / "__init__.py").write_text("")
            shutil.copy(WORKERS / "same_start_tape.py", package / "train.py")
            job = run([sys.executable, "-m", "aiacc.launcher", "-np", "2", sys.executable, "-m",
                       f"{package.name}.train", "0", "1"], env={"PYTHONPATH": f"{top}{os.pathsep}{WORKERS}"},
                      timeout=240)  # (the workers' report module: on the path)
        finally:
            shutil.rmtree(package)
        assert_ok(job, 2)
        _check_warned(job, True, "DistributedGradientTape: the ranks do not train the same model")
        for r in range(2):
            assert "UserWarning train.py:" in _warned(job, r)[0], job.output

    def test_a_rank_whose_traced_step_fails_alone_has_joined_the_comparison_first(self):
        # rank 1's second step: its output layer's gradients None there alone, an error that rank finds after the
        # step's collectives; the comparison ran before it on both ranks (placed after it, rank 0 waited in it)
        job = aiaccrun(2, "same_start_tape.py", "0", "1", "alone", timeout=240)
        assert_ok(job, 2)
        said = re.findall(r"ALONE rank=(\d) (.*)", job.output)
        assert [r for r, _ in said] == ["1"] and "is None on this rank (rank 1)" in said[0][1], job.output
        # (the gradients' names are positional, the same on every rank; the error says which variables they are)
        assert "'DistributedGradientTape.2.kernel' is variable 'sequential/out/kernel'" in said[0][1], said
        for r in range(2):
            assert len(_warned(job, r)) == 1, job.output
        _check_counts(job, range(2), extra=2)
