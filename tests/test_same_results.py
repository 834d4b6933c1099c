"""The same call gives the same result in every framework: one table of cases (``same_results_table``) run
through aiacc.torch, aiacc.tensorflow and aiacc.mxnet at 2 ranks, each answer equal to the other adapters'
(values, dtype, shape; or exception family and message) and to a numpy reference. By hand at other numbers of
ranks: SAME_RESULTS_RANKS=3 python -m pytest tests/test_same_results.py (passes at 3 and 4)."""

import json
import sys

import numpy as np

from conftest import TENSORFLOW, WORKERS, aiaccrun, assert_ok, need_framework, python

need_framework("torch")
need_framework("tensorflow", TENSORFLOW)
need_framework("mxnet")

sys.path.insert(0, str(WORKERS))
from same_results_table import CASES, SIZE, checks, expected  # noqa: E402 - a worker module, numpy only


def _results(job):
    found = {}
    for line in job.lines("RESULT "):
        item = json.loads(line[len("RESULT "):])
        key = (item.pop("case"), item.pop("rank"), item.pop("framework"))
        assert key not in found, f"{key} reported twice"
        found[key] = item
    return found


def _check_values(where, got, want, tolerance):
    assert got["dtype"] == want.dtype.name, f"{where}: dtype {got['dtype']} != {want.dtype.name}"
    assert tuple(got["shape"]) == want.shape, f"{where}: shape {got['shape']} != {want.shape}"
    floating = want.dtype.kind == "f" or want.dtype.name == "bfloat16"
    values = np.array(got["values"], dtype=np.float64 if floating else want.dtype).reshape(want.shape)
    if tolerance:
        assert np.allclose(values, want.astype(np.float64), rtol=tolerance, atol=tolerance), \
            f"{where}: {values.ravel()[:6]} != {want.ravel()[:6]}"
    else:
        assert np.array_equal(values, want), f"{where}: {values.ravel()[:6]} != {want.ravel()[:6]}"


def test_every_adapter_gives_the_same_result_and_error_for_every_case():
    job = aiaccrun(SIZE, "same_results.py", timeout=420)
    assert_ok(job, SIZE, checks=checks())
    results = _results(job)
    assert len(results) == SIZE * checks(), f"{len(results)} results reported, {SIZE * checks()} expected"
    compared, failures = 0, []
    for case in CASES:
        for rank in range(SIZE):
            try:
                _check_case(case, rank, results)
            except AssertionError as exc:
                failures.append(str(exc))
            compared += 1
    assert not failures, "\n".join(failures)
    assert compared == SIZE * len(CASES)


def _check_case(case, rank, results):
    answers = {fw: results[(case.id, rank, fw)] for fw in case.frameworks}
    first = answers[case.frameworks[0]]
    for fw, answer in answers.items():
        # the adapters agree with each other to the letter (values, dtypes, shapes, messages)
        assert answer == first, f"{case.id} on rank {rank}: {fw} answered {answer}, {case.frameworks[0]} {first}"
    want = expected(case, rank)
    where = f"{case.id} on rank {rank}"
    if want[0] == "error":
        assert first.get("error") == want[1], f"{where}: expected {want[1]}, got {first}"
        assert want[2] in first["message"], f"{where}: message lacks {want[2]!r}: {first['message']}"
        return
    assert "error" not in first, f"{where}: raised {first}"
    assert len(first["arrays"]) == len(want[1]), where
    for got, w in zip(first["arrays"], want[1]):
        _check_values(where, got, w, case.tolerance)
    assert first["received"] == want[2], f"{where}: received splits {first['received']} != {want[2]}"


def test_gradient_wrappers_made_before_init_agree_in_every_adapter():
    """Switched off, every adapter's wrapper hands back the framework's own object, before init() too;
    switched on but not initialised, every one raises NotInitializedError naming itself."""
    assert_ok(python("wrappers_before_init.py"), 1, checks=5)
    assert_ok(python("wrappers_before_init.py", "on", env={"AIACC_ENABLE": "1"}), 1, checks=5)
