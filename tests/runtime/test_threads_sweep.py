"""benchmarks/threads_sweep.py: TG against -t on the real CPU llama-bench (tiny model, every tensor on the CPU), its
report and best count; llama-bench's records read back into the same report; bad input one line and exit 2."""
from __future__ import annotations

import json

import pytest


@pytest.fixture
def sweep(bench_script):
    return bench_script("threads_sweep")


def test_a_sweep_measures_each_count_and_names_the_best(sweep, llama_bench, tiny_gguf, tmp_path, capsys):
    model = tiny_gguf("qwen3moe")
    assert sweep.main(["--model", str(model), "--llama-bench", str(llama_bench), "--placement", "-ngl 0",
                       "--threads", "1,2", "--n-gen", "4", "--reps", "2", "--name", "t", "--out", str(tmp_path)]) == 0
    best = int(capsys.readouterr().out.strip().splitlines()[-1])
    out = json.loads((tmp_path / "t.json").read_text())
    assert [r["threads"] for r in out["rows"]] == [1, 2] and best == out["best"] in (1, 2)
    assert all(r["tg"] > 0 and len(r["samples"]) == 2 for r in out["rows"])
    assert max(r["vs_best"] for r in out["rows"]) == 1.0
    md = (tmp_path / "t.md").read_text()
    assert f"Best: -t {best}," in md and "| 2 |" in md
    # the records alone give the same report
    (tmp_path / "raw.json").write_text(json.dumps(out["records"]))
    assert sweep.main(["--from", str(tmp_path / "raw.json"), "--name", "again", "--out", str(tmp_path)]) == 0
    assert json.loads((tmp_path / "again.json").read_text())["rows"] == out["rows"]


@pytest.mark.parametrize("argv, says", [
    (["--threads", "8,x"], "--threads 8,x"),
    (["--threads", "0,8"], "1 or more"),
    (["--model", "/nonexistent.gguf"], "no such file"),
])
def test_bad_input_is_one_line_and_exit_2(sweep, argv, says, tmp_path, capsys):
    assert sweep.main([*argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1


def test_records_without_a_tg_test_are_refused(sweep, tmp_path, capsys):
    (tmp_path / "pp.json").write_text(json.dumps([{"n_threads": 8, "n_prompt": 512, "n_gen": 0, "avg_ts": 1.0,
                                                   "stddev_ts": 0.0}]))
    assert sweep.main(["--from", str(tmp_path / "pp.json"), "--out", str(tmp_path)]) == 2
    assert "no TG record" in capsys.readouterr().err
