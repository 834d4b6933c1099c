"""``python -m aiacc.bench report``: every framework's train bench lands in one table."""

import json
import sys

import pytest

from conftest import ROOT, run


def test_report_tables_every_framework(tmp_path):
    out = tmp_path / "report"
    job = run([sys.executable, "-m", "aiacc.bench", "report", "--out", str(out), "--benches", "train",
               "--frameworks", "torch,tensorflow,mxnet,jax", "--models", "cnn", "--links", "shm",
               "--train-args", "--batch-size 4 --steps 1 --warmup 1 --repeats 1"], timeout=400)
    assert job.returncode == 0, job.output
    text = (out / "report.md").read_text()
    assert "jobs that failed" not in text, text
    rows = [line.split("|")[1:-1] for line in text.splitlines() if line.startswith("| ")]
    header = [c.strip() for c in rows[0]]
    table = [dict(zip(header, (c.strip() for c in r))) for r in rows[1:]]
    impls = {(r["framework"], r["impl"]) for r in table}
    for want in [("torch", "aiacc"), ("torch", "ddp"), ("torch", "ddp-tuned"), ("tensorflow", "aiacc"),
                 ("tensorflow", "tf-mwms"), ("mxnet", "aiacc"), ("mxnet", "ps-dist_sync"), ("jax", "aiacc"), ("jax", "jax-dp")]:
        assert want in impls, (want, text)
    for r in table:
        assert float(r["samples/s"]) > 0 and float(r["step ms"]) > 0, r
        if r["impl"] in ("ddp", "tf-mwms", "ps-dist_sync", "jax-dp"):
            assert float(r["vs baseline"]) == 1, r  # each framework's peer
        assert float(r["compute ms"]) > 0, r  # the breakdown exists for every framework
    saved = json.loads((out / "results.json").read_text())
    assert len(saved["train"]) == len(table)
    meta = saved["meta"]  # what made the figures: commit, command, settings, machine
    assert meta["commit"] and "--train-args" in meta["command"] and meta["np"] == 2, meta
    assert meta["machine"]["cores"] > 0 and meta["machine"]["cpu"] and "torch" in meta["machine"], meta
    assert f"Commit `{meta['commit']}`" in text
    # the report can be written again from its results without running anything
    again = run([sys.executable, "-m", "aiacc.bench", "report", "--out", str(tmp_path / "again"),
                 "--from-results", str(out / "results.json")], timeout=60)
    assert again.returncode == 0, again.output
    assert (tmp_path / "again" / "report.md").read_text() == text


def _bench_records(*args):
    job = run([sys.executable, "-m", "aiacc.launcher", "-np", "2", sys.executable, "-m", "aiacc.bench", *args,
               "--json"], timeout=120)
    assert job.returncode == 0, job.output
    return [json.loads(line) for line in job.output.splitlines() if line.startswith("{")]


def test_allreduce_and_fusion_benches_print_every_figure():
    rows = _bench_records("allreduce", "--min-bytes", "4KiB", "--max-bytes", "64KiB", "--repeats", "1",
                          "--target-seconds", "0.005")
    assert [r["bytes"] for r in rows] == [4096, 16384, 65536], rows
    for r in rows:
        for key in ("raw_us", "aiacc_us", "aiacc_vs_raw"):
            assert r[key] > 0, (key, r)
    (fusion,) = _bench_records("fusion", "--tensors", "50", "--bytes", "1KiB", "--repeats", "2")
    assert fusion["tensors"] == 50 and fusion["bytes_each"] == 1024, fusion
    for key in ("aiacc_ms", "raw_each_ms", "raw_fused_ms", "grouped_ms", "aiacc_vs_raw_fused", "grouped_vs_raw_fused"):
        assert fusion[key] > 0, (key, fusion)


def test_readme_tables_and_docs_bench_are_made_from_the_committed_results():
    """The README's performance tables and docs/bench/report.md are what `python -m aiacc.bench report`
    writes from docs/bench/results.json: a figure edited by hand, or results.json changed without the
    tables, fails here."""
    from aiacc.bench import report

    results = json.loads((ROOT / "docs" / "bench" / "results.json").read_text())
    assert results["meta"]["commit"] and results["meta"]["machine"]["cores"], results["meta"]
    readme = (ROOT / "README.md").read_text()
    assert report.current_block(readme) == report.readme_block(results), \
        "README.md's tables differ from docs/bench/results.json: run python -m aiacc.bench report " \
        "--out docs/bench --from-results docs/bench/results.json --readme README.md"
    written = (ROOT / "docs" / "bench" / "report.md").read_text()
    assert written.startswith(report.markdown(results)[:-1]), "docs/bench/report.md differs from its results.json"


def test_table_cells_read_as_plain_numbers():
    # samples/s of 1000 and more were written 1.06e+03 in the README's tables
    from aiacc.bench import report

    rows = [{"impl": "aiacc", "samples/s": 1057.6, "step ms": 60.28, "vs baseline": 1.0},
            {"impl": "ddp", "samples/s": 999.6, "step ms": 999.4, "vs baseline": 0.9456}]
    table = report._table(rows, ["impl", "samples/s", "step ms", "vs baseline"])
    assert table.splitlines()[-2:] == ["| aiacc | 1058 | 60.3 | 1 |", "| ddp | 1000 | 999 | 0.946 |"], table


def test_train_help_is_found_without_a_framework():
    # `train -h` said "--framework ... is required" and exited 2: its options could not be found through -h
    job = run([sys.executable, "-m", "aiacc.bench", "train", "-h"])
    assert job.returncode == 0 and "--framework torch|tensorflow|mxnet|jax" in job.output, job.output
    job = run([sys.executable, "-m", "aiacc.bench", "train", "--framework", "torch", "-h"])
    assert job.returncode == 0 and "--sweep-mb" in job.output and "--model" in job.output, job.output


@pytest.mark.parametrize("args,words", [
    (["allreduce", "--factor", "1"], "argument --factor: expected a whole number >= 2, got '1'"),  # (it never ended)
    (["fusion", "--repeats", "0"], "argument --repeats: expected a whole number >= 1, got '0'"),
    (["train", "--framework", "torch", "--steps", "0"], "argument --steps: expected a whole number >= 1"),
    (["train", "--framework", "torch", "--sweep-mb", "1,abc"], "argument --sweep-mb: expected a finite number > 0"),
    (["predict", "--efficiency", "0"], "argument --efficiency: expected a number in (0, 1], got '0'"),
    (["predict", "--link", "0gbit"], "--link '0gbit': expected a rate > 0"),
    (["scaling", "--hosts", "1", "--link", "1gbit,garbage"], "--link 'garbage': expected a rate > 0"),
    (["scaling", "--hosts", "1", "--link", "5bit", "--dilate", "10"], "leaves 0.5 bit/s"),
    (["replay", "--dilate", "inf"], "argument --dilate: expected a finite number > 0, got 'inf'"),
    (["c10d", "--models", "cnn,bogus"], "--models: unknown model 'bogus'"),  # (it was found after the allreduce part)
    # sizes: 0 never ended, 'abc' and '1e99' were tracebacks on every rank, 6 reported 6 bytes and reduced 4
    (["allreduce", "--min-bytes", "0"], "argument --min-bytes: expected a whole number of float32 elements"),
    (["allreduce", "--max-bytes", "abc"], "argument --max-bytes: expected a size such as 4KiB or 16MiB, got 'abc'"),
    (["allreduce", "--max-bytes", "100000GiB"], "argument --max-bytes: '100000GiB' is more than this machine's memory"),
    (["allreduce", "--min-bytes", "1MiB", "--max-bytes", "4KiB"], "--min-bytes (1048576 bytes) is above --max-bytes"),
    (["fusion", "--bytes", "6"], "argument --bytes: expected a whole number of float32 elements"),
    (["c10d", "--sizes", "3"], "--sizes '3': expected a whole number of float32 elements"),
    (["train", "--framework", "torch", "--sweep-mb", ","], "argument --sweep-mb: expected numbers > 0"),  # (a traceback)
    (["train", "--framework", "tensorflow", "--threads", "-1"], "argument --threads: expected a whole number >= 1"),
    (["train", "--framework", "jax", "--impls", ","], "--impls ',': name at least one of"),  # (nothing ran, exit 0)
    (["train", "--framework", "mxnet", "--dist-timeout", "inf"], "argument --dist-timeout: expected a finite number"),
    (["report", "--out", "o", "--benches", "fusionn"], "--benches 'fusionn': unknown 'fusionn'; choose from allreduce"),
    (["report", "--out", "o", "--np", "0"], "argument --np: expected a whole number >= 1, got '0'"),
    (["report", "--out", "o", "--timeout", "nan"], "argument --timeout: expected a finite number > 0"),
    (["report", "--out", "o", "--from-results", "nosuch.json"], "--from-results 'nosuch.json': No such file"),
])
def test_bad_bench_arguments_are_the_parsers_error_naming_the_flag(args, words):
    # before anything runs: no traceback, no figures from a nonsense setting, no sweep that never ends
    job = run([sys.executable, "-m", "aiacc.bench", *args], timeout=120)
    assert job.returncode == 2, job.output
    assert words in job.output and "Traceback" not in job.output, job.output


def test_report_checks_its_readme_and_results_before_it_writes_anything(tmp_path):
    """A README without the generated block was emptied (opened for writing before the check); a results.json
    that is not one was a traceback, after --out was made."""
    readme = tmp_path / "mine.md"
    readme.write_text("# My project\n\nImportant text\n")
    job = run([sys.executable, "-m", "aiacc.bench", "report", "--out", str(tmp_path / "o"), "--from-results",
               str(ROOT / "docs/bench/results.json"), "--readme", str(readme)])
    assert job.returncode == 2 and "has no generated block" in job.output, job.output
    assert readme.read_text() == "# My project\n\nImportant text\n"
    foreign = tmp_path / "foreign.json"
    for text in ("", "[1, 2]", '{"allreduce": [], "fusion": [], "train": [{"model": "cnn"}]}'):
        foreign.write_text(text)
        job = run([sys.executable, "-m", "aiacc.bench", "report", "--out", str(tmp_path / "o"), "--from-results",
                   str(foreign)])
        assert job.returncode == 2 and f"--from-results '{foreign}'" in job.output, job.output
        assert "Traceback" not in job.output and not (tmp_path / "o").exists(), job.output


def test_recovery_bench_refuses_to_run_under_aiaccrun():
    """It starts its own jobs: under aiaccrun every rank ran the whole bench, the jobs timing each other."""
    job = run([sys.executable, "-m", "aiacc.launcher", "-np", "2", sys.executable, "-m", "aiacc.bench", "recovery",
               "--runs", "0", "--state-mb", "0"], timeout=120)
    assert job.returncode != 0 and "starts its own jobs; run it without aiaccrun" in job.output, job.output
