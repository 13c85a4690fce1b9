"""A whole `tune` study on the real CPU llama-bench (issue 10): llama.cpp's own --fit (llama-bench -fitt) and the
other baselines measured and stored, kept across a resume, confirmation interleaved with --fit, and the report's
ratios to --fit. The CPU build has no GPU, so every plan runs with its tensors on the CPU (--cpu-stand-in): the
speeds say nothing of the GPU plans, the pipeline is the real one."""
from __future__ import annotations

import json

import pytest

from offload_tuner.cli import main
from runtime.synth import tiny_spec, uniform_recipe, write_gguf

pytestmark = pytest.mark.llamacpp


def _tune(llama_bench, model, tmp_path, trials: int) -> list[str]:
    # a 1 GiB stand-in GPU keeps nothing free (the default 1024 MiB would leave it none)
    return ["tune", str(model), "--engine", "llamacpp", "--llama-bench", str(llama_bench), "--cpu-stand-in",
            "--gpu", "1GiB", "--keep-free", "0", "--trials", str(trials), "--n-prompt", "16", "--n-gen", "4",
            "--reps", "1", "--confirm", "2", "--objective", "both", "--study", "cpu",
            "--storage", f"sqlite:///{tmp_path / 's.db'}", "--out", str(tmp_path / "report"), "--pool", "20",
            "--quiet", "--json"]


@pytest.mark.slow
def test_a_llamacpp_study_measures_fit_keeps_its_baselines_and_reports_ratios(llama_bench, tmp_path, capsys):
    model = write_gguf(tmp_path / "tiny.gguf", tiny_spec("qwen3moe", n_layer=6, n_expert=8, n_expert_used=2),
                       uniform_recipe("Q4_0"))[0]
    assert main(_tune(llama_bench, model, tmp_path, 2)) == 0
    s = json.loads(capsys.readouterr().out)
    base = {b["kind"]: b for b in s["baselines"]}
    assert {"engine-fit", "cmoe", "ncmoe"} <= set(base)
    fit = base["engine-fit"]
    assert fit["name"] == "--fit" and fit["ok"] and "-fitt" in fit["argv"] and fit["measured"]["tg_tps"] > 0
    assert base["cmoe"]["ok"] and base["cmoe"]["tg_x"] is not None      # ratios to --fit on every other baseline
    runs = s["engine_runs"]
    assert runs["baselines"] == sum(b["runs"] for b in s["baselines"]) and runs["trials"] >= 2
    # confirmation: --fit and the finalists, each run twice, interleaved
    conf = s["confirmed"]
    assert conf["reference"] == "fit" and conf["results"][0]["key"] == "fit"
    assert all(len(r["tg"]["samples"]) == 2 for r in conf["results"])
    assert runs["confirmation"] == 2 * len(conf["results"])
    assert all("tg_vs_fit" in r for r in conf["results"][1:])
    md = (tmp_path / "report" / "summary.md").read_text()
    assert "## Confirmed against --fit" in md and "| --fit |" in md and "TG x" in md
    assert "-fitt" in md                                             # --fit's own command line is shown
    # the thread probe ran first (tuner/threads.py) and the report says what it settled at
    assert s["threads"].startswith("threads: llama.cpp's default -t generated ") and s["threads"] in md
    # a resumed study keeps its baselines (no second --fit run) and adds runs
    assert main(_tune(llama_bench, model, tmp_path, 1)) == 0
    s2 = json.loads(capsys.readouterr().out)
    assert s2["baselines"][0]["measured"] == fit["measured"]
    assert s2["engine_runs"]["baselines"] == runs["baselines"]
    assert s2["engine_runs"]["trials"] == runs["trials"] + 1
    assert s2["threads"] == s["threads"]                              # the stored probe, not a second one


@pytest.mark.slow
def test_tune_vs_fit_benchmark_dry_run(llama_bench, tmp_path, bench_script):
    """benchmarks/tune_vs_fit.py --cpu: the GPU benchmark's whole pipeline on the CPU build; the JSON has the rows
    the issue asks for, and a second call resumes (nothing left to run)."""
    bench = bench_script("tune_vs_fit")
    argv = ["--cpu", "--workdir", str(tmp_path / "work"), "--out", str(tmp_path / "out"), "--budgets", "1",
            "--depths", "0", "--runs", "14", "--confirm", "2", "--pool", "20"]
    assert bench.main(argv) == 0
    rep = json.loads((tmp_path / "out" / "tune_vs_fit.json").read_text())
    row = rep["budgets"][0]
    assert {"budget_gib", "depth", "runs", "fit", "best_tg", "balanced", "best_tg_ratio", "balanced_tg_ratio",
            "balanced_pp_ratio"} <= set(row)
    assert row["budget_gib"] == 1 and row["confirmed"] and row["runs"] <= 14
    assert {"tg", "pp", "vram_mib", "flags"} <= set(row["fit"]) and row["best_tg_ratio"] is not None
    assert (tmp_path / "out" / "tune_vs_fit.md").exists() and (tmp_path / "out" / "tune_vs_fit.png").exists()
    lines = (tmp_path / "out" / "tune_vs_fit_runs.jsonl").read_text().splitlines()
    assert lines and {"llama_bench_args", "env", "pp_tps", "tg_tps", "peak_vram_mib"} <= set(json.loads(lines[0]))
    import gzip                           # the state copy beside the report: the database, whole
    (tmp_path / "copy.db").write_bytes(gzip.decompress((tmp_path / "out" / bench.STATE_NAME).read_bytes()))
    import optuna
    copy = optuna.load_study(study_name="tvf-1g-d0", storage=f"sqlite:///{tmp_path / 'copy.db'}")
    assert copy.user_attrs.get("confirmed") and len(copy.trials) >= 1
    assert bench.main(argv) == 0          # resumed: every cell is confirmed already
    # the space `tune` gives a real mainline engine: --no-host in it
    study = optuna.load_study(study_name="tvf-1g-d0", storage=f"sqlite:///{tmp_path / 'work' / 'tune_vs_fit.db'}")
    assert study.user_attrs["settings"]["space"]["no_host"] == [False, True]
    # a --series is a fresh study beside the confirmed one: work left (no time to start it here), no rows yet
    assert bench.main([*argv, "--series", "nh", "--time-budget", "1", "--name", "nh"]) == 3
    assert json.loads((tmp_path / "out" / "nh.json").read_text())["budgets"] == []


@pytest.mark.slow
def test_reconfirm_runs_a_refused_server_fit_and_confirms_again(llama_bench, tmp_path, bench_script):
    """A study whose '--fit's placement in a server' was refused by an older budget check (the H100 16 GiB cell
    of the first benchmark) gets it measured, unjudged, and a new confirmation that interleaves it."""
    import optuna
    bench = bench_script("tune_vs_fit")
    argv = ["--cpu", "--workdir", str(tmp_path / "work"), "--out", str(tmp_path / "out"), "--budgets", "1",
            "--depths", "0", "--runs", "12", "--confirm", "2", "--pool", "20"]
    assert bench.main(argv) == 0
    study = optuna.load_study(study_name="tvf-1g-d0", storage=f"sqlite:///{tmp_path / 'work' / 'tune_vs_fit.db'}")
    base = study.user_attrs["baselines"]
    i = next(k for k, b in enumerate(base) if b["kind"] == "engine-fit-server")
    base[i] = {"name": base[i]["name"], "kind": "engine-fit-server", "ok": False, "runs": 0,
               "error": "not run: over budget (CUDA0: needs 16.16 GiB, budget 15.75 GiB)"}
    study.set_user_attr("baselines", base)
    old = study.user_attrs["confirmed"]
    assert bench.main(argv) == 0                  # without --reconfirm: nothing to do
    assert not study.user_attrs["baselines"][i]["ok"]
    assert bench.main([*argv, "--reconfirm"]) == 0
    server = study.user_attrs["baselines"][i]
    assert server["ok"] and server["runs"] == 1 and server["measured"]["tg_tps"] > 0
    assert study.user_attrs["confirmed_before_redo"] == old
    keys = [r["key"] for r in study.user_attrs["confirmed"]["results"]]
    assert keys[:2] == ["fit", "fit-server"]
    row = json.loads((tmp_path / "out" / "tune_vs_fit.json").read_text())["budgets"][0]
    assert row["fit_server"] and row["fit_server"]["tg"] > 0
