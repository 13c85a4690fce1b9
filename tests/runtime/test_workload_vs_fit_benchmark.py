"""benchmarks/workload_vs_fit.py's whole pipeline on this machine (--cpu): a time-objective study explored by the
sim engine, then the --fit references and a finalist served as the real CPU llama-server on a tiny workload, the
verdict in the report, a second call resuming with nothing re-run, and no llama-server left behind."""
from __future__ import annotations

import json
import subprocess

import pytest

pytestmark = pytest.mark.slow


def _servers() -> list[str]:
    r = subprocess.run(["pgrep", "-x", "llama-server"], capture_output=True, text=True)
    return r.stdout.split()


def test_workload_vs_fit_dry_run(bench_script, llama_server, tmp_path):
    bench = bench_script("workload_vs_fit")
    argv = ["--cpu", "--cells", "6:rag", "--trials", "3", "--rounds", "1", "--finalists", "1",
            "--workdir", str(tmp_path / "w"), "--out", str(tmp_path / "out"), "--server", str(llama_server)]
    assert bench.main(argv) == 0
    rep = json.loads((tmp_path / "out" / "workload_vs_fit.json").read_text())
    (cell,) = rep["cells"]
    assert cell["served"] and cell["workload"] == "rag" and cell["budget_gib"] == 6
    # three --fit references and one finalist, one round each: four server runs
    assert cell["served_runs"] == 4 and len(cell["results"]) == 4
    assert {r["key"] for r in cell["results"]} >= {"fit:512", "fit:2048", "fit:4096"}
    ref, pick = cell["reference"], cell["pick"]
    assert ref["name"].startswith("--fit") and pick["request_s"]["median"] <= ref["request_s"]["median"]
    assert "rag: " in cell["headline"]          # after what the pick gives up, when it gives anything up
    assert "llama-server" in (ref["command"] or "") and "-c " in ref["command"]
    md = (tmp_path / "out" / "workload_vs_fit.md").read_text()
    assert "| 6 GiB | rag |" in md and (tmp_path / "out" / "workload_vs_fit.png").stat().st_size > 0
    # the finalist is set beside the reference whichever is the pick
    fin = cell["best_finalist"]
    assert fin["name"].startswith("trial ") and f"- 6 GiB rag: {fin['name']}: request " in md
    assert not _servers()
    # a second call finds every cell served and runs nothing more
    assert bench.main(argv) == 0
    again = json.loads((tmp_path / "out" / "workload_vs_fit.json").read_text())["cells"][0]
    assert again["served_runs"] == 4 and again["results"] == cell["results"]


def test_cells_name_one_or_several_gpus(bench_script):
    bench = bench_script("workload_vs_fit")
    one, two, mixed = bench.parse_cells("12:rag,2x8:agent,24+16+16+8:agent")
    # one GPU keeps the study names the stored H100 studies have; several GPUs say how many, mixed cards each size
    assert (one.name(""), one.label, one.budgets()) == ("wvf-12g-rag", "12 GiB", {"CUDA0": 12 << 30})
    assert (two.name("s"), two.label) == ("wvf-2x8g-agent-s", "2x8 GiB")
    assert two.budgets() == {"CUDA0": 8 << 30, "CUDA1": 8 << 30}
    assert (mixed.name("", "235b-a22b"), mixed.n_gpus) == ("wvf-235b-a22b-24+16+16+8g-agent", 4)
    assert mixed.budgets()["CUDA3"] == 8 << 30
    for bad in ("x8:agent", "0x8:agent", "2x:agent", "8:poem", "8", "2x8+8:agent", "8+:agent", "8+0:agent"):
        with pytest.raises(SystemExit, match="GIB:WORKLOAD"):
            bench.parse_cells(bad)
    # the default shape's model keeps its stored path and study names; another shape gets its own
    import llamacpp_gpu
    assert bench.model_rel(llamacpp_gpu.PRESET) == bench.MODEL_REL and bench.model_tag(llamacpp_gpu.PRESET) == ""
    assert bench.model_tag("Qwen3-235B-A22B:Q8_0") == "235b-a22b"
    with pytest.raises(SystemExit, match="--preset"):
        bench.main(["--preset", "Nope:Q4_0", "--report-only", "x.json"])


def test_a_served_two_gpu_command_says_how_it_shares_the_model_out(bench_script):
    """The report's split of a finalist as served (its -ts and -ot read back), none for a --fit that moves experts
    itself at load, nor for one GPU."""
    from planner.presets import load_preset
    bench = bench_script("workload_vs_fit")
    inv = load_preset("Qwen3-30B-A3B:Q4_K_M").inventory()
    cmd = ("llama-server -m m.gguf -ngl 99 -ts 1,3 -ot blk\\.([0-9]|1[0-9])\\.ffn_(up|down|gate)_exps=CPU "
           "-c 4096 --no-webui")
    words = bench.split_words(cmd, inv, 2)
    cuda0, cuda1 = words.split("; ")
    # 49 slots by 1:3 (48 blocks + the output layer) as llama.cpp rounds them: 13 blocks on CUDA0, whose experts
    # sit in RAM (blocks 0-19), 35 and the output layer on CUDA1
    assert cuda0 == "CUDA0: 13 layers" and cuda1.startswith("CUDA1: 35 layers, ")
    assert cuda1.endswith("GiB of experts, the output layer")
    assert bench.split_words("llama-server -m m.gguf --fit on -c 4096", inv, 2) is None
    assert bench.split_words(cmd, inv, 1) is None and bench.split_words(None, inv, 2) is None
