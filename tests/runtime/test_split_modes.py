"""benchmarks/split_modes.py on the real CPU llama-bench (tiny model): every mode runs in every round, a mode the
build cannot load (tensor needs a GPU device) is a failed row with its error line, a second call runs nothing again,
and bad input is one line and exit 2."""
from __future__ import annotations

import json

import pytest


@pytest.fixture
def split(bench_script):
    return bench_script("split_modes")


def test_modes_run_interleaved_and_a_refused_mode_is_a_row(split, llama_bench, tiny_gguf, tmp_path):
    model = tiny_gguf("qwen3moe")
    argv = ["--model", str(model), "--bench", f"mainline={llama_bench}", "--modes", "mainline:layer,mainline:tensor",
            "--placement", "cpu=-ngl 0", "-t", "2", "-p", "16", "-n", "4", "-r", "1", "--rounds", "2",
            "--workdir", str(tmp_path / "w"), "--out", str(tmp_path), "--name", "s"]
    assert split.main(argv) == 0
    out = json.loads((tmp_path / "s.json").read_text())
    assert [r["key"] for r in out["runs"]] == ["0/cpu/mainline/layer", "0/cpu/mainline/tensor",
                                               "1/cpu/mainline/tensor", "1/cpu/mainline/layer"]
    layer, tensor = out["rows"]
    assert layer["ok"] == 2 and layer["pp"]["median"] > 0 and layer["tg"]["median"] > 0
    assert tensor["ok"] == 0 and tensor["runs"] == 2 and tensor["errors"]
    assert "LLAMA_SPLIT_MODE_TENSOR needs >= 1 devices" in tensor["errors"][0]        # the cause, not the summary
    md = (tmp_path / "s.md").read_text()
    assert "| mainline | layer |" in md and "2 of 2" in md and "0 of 2" in md
    assert "- mainline: fewer than two modes ran" in md
    # resumed: every run is found in the runs file, none is run again
    lines = (tmp_path / "w" / "s_runs.jsonl").read_text().splitlines()
    assert split.main(argv) == 0
    assert (tmp_path / "w" / "s_runs.jsonl").read_text().splitlines() == lines


def test_verdict_says_ahead_only_when_the_spreads_are_apart(split):
    def row(mode, lo, med, hi):
        return {"mode": mode, "pp": {"median": med, "lo": lo, "hi": hi}}
    assert split.verdict([row("layer", 90, 100, 110), row("tensor", 40, 50, 60)], "pp") \
        == "PP: -sm layer ahead (100.0 t/s, 2.00x tensor)"
    assert "a tie inside the spreads" in split.verdict([row("tensor", 80, 95, 99), row("layer", 85, 100, 110)], "pp")
    assert split.verdict([row("layer", 1, 2, 3), {"mode": "tensor", "pp": None}], "pp") is None


def test_reports_merge_into_one(split, tmp_path):
    def report(engine, modes, key_round):
        runs = [{"key": f"{key_round}/p/{engine}/{m}", "round": key_round, "placement": "p", "engine": engine,
                 "mode": m, "ok": True, "pp": 10.0 * (i + 1), "tg": 1.0 * (i + 1), "vram_mib": {"CUDA0": 100.0}}
                for i, m in enumerate(modes)]
        meta = {"name": engine, "date": "2026-11-28", "gpu": "2x GPU", "model": "m.gguf", "threads": 8,
                "n_prompt": 64, "n_gen": 8, "reps": 1, "rounds": 1, "modes": [f"{engine}:{m}" for m in modes],
                "placements": {"p": "-ngl 99"}, "note": None}
        path = tmp_path / f"{engine}.json"
        path.write_text(json.dumps({"meta": meta, "rows": [], "runs": runs}))
        return str(path)
    note = tmp_path / "note.md"
    note.write_text("Ran in two calls.")
    assert split.main(["--report-only", report("mainline", ["layer", "tensor"], 0), report("ik", ["layer", "graph"], 0),
                       "--name", "both", "--note", str(note), "--out", str(tmp_path)]) == 0
    out = json.loads((tmp_path / "both.json").read_text())
    assert out["meta"]["modes"] == ["mainline:layer", "mainline:tensor", "ik:layer", "ik:graph"]
    assert [(r["engine"], r["mode"], r["ok"]) for r in out["rows"]] == [
        ("mainline", "layer", 1), ("mainline", "tensor", 1), ("ik", "layer", 1), ("ik", "graph", 1)]
    md = (tmp_path / "both.md").read_text()
    assert "- mainline: PP: -sm tensor ahead (20.0 t/s, 2.00x layer)" in md and "- ik: PP: -sm graph" in md
    assert md.rstrip().endswith("Ran in two calls.")
    (tmp_path / "bad.json").write_text("{}")
    assert split.main(["--report-only", str(tmp_path / "bad.json"), "--out", str(tmp_path)]) == 2


def test_no_run_starts_past_the_budget(split, llama_bench, tiny_gguf, tmp_path):
    model = tiny_gguf("qwen3moe")
    assert split.main(["--model", str(model), "--bench", f"mainline={llama_bench}", "--modes", "mainline:layer",
                       "--placement", "cpu=-ngl 0", "--time-budget", "5", "--min-left", "10",
                       "--workdir", str(tmp_path), "--out", str(tmp_path)]) == 3
    assert json.loads((tmp_path / "split_modes.json").read_text())["runs"] == []


@pytest.mark.parametrize("argv, says", [
    (["--modes", "mainline:graph"], "--modes 'mainline:graph'"),
    (["--modes", "ik:row"], "ik: none, layer, graph"),
    (["--placement=-ngl 99"], "give NAME=LLAMA-BENCH FLAGS"),
    (["--placement", "x=-ngl 99 -sm row"], "the benchmark's own flags"),
    (["--bench", "vulkan=/x"], "--bench 'vulkan=/x'"),
    (["--bench", "mainline=/nonexistent/llama-bench"], "no mainline llama-bench at /nonexistent/llama-bench"),
    (["-t", "0"], "1 or more"),
])
def test_bad_input_is_one_line_and_exit_2(split, argv, says, llama_bench, tmp_path, capsys):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    base = ["--model", str(model), "--bench", f"mainline={llama_bench}", "--workdir", str(tmp_path)]
    assert split.main([*base, *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1
