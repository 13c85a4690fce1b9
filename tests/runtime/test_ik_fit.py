"""ik_llama.cpp's own --fit as the llamacpp engine measures it (LlamaCppEngine.own_fit with ik's llama-sweep-bench),
on the real CPU ik build (runtime/ik_build.py).

A CPU build still runs ik's fit block (src/llama.cpp ~4420), against 0 MiB of device memory: --fit always ends in
"Unable to auto-fit model" there, after logging every decision it took. So the tests check that ik accepts the
line we give it and that we read its real decision log; and that a `tune --cpu-stand-in` study on the sweep binary
(--fit dropped: all-CPU, like every stand-in plan) stores the baseline, with its sweep-bench line, and confirms
against it. What the fit chooses on a GPU is measured by benchmarks/ik_gpu.py on the GPU box."""
from __future__ import annotations

import json

import pytest

from tuner.baselines import flag_plan
from offload_tuner.cli import main
from planner.gguf_header import load_inventory
from planner.plan import Knobs
from planner.engine_contract import BenchRun
from runtime.llamacpp import LlamaCppEngine
from runtime.llamacpp_logs import IkFitChoice, parse_ik_fit
from runtime.synth import tiny_spec, uniform_recipe, write_gguf

pytestmark = pytest.mark.ik


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("ik_fit")
    return write_gguf(d / "tiny.gguf", tiny_spec("qwen3moe", n_layer=6, n_expert=8, n_expert_used=2),
                      uniform_recipe("Q4_0"))[0]


def test_ik_accepts_our_fit_line_and_we_read_its_decision_log(ik_binaries, model):
    engine = LlamaCppEngine(ik_binaries["llama-sweep-bench"], timeout_s=120)
    fit = engine.own_fit(load_inventory(model), BenchRun(16, 4, 0, 1), {"CUDA0": 1 << 30})
    assert fit is not None and fit.program == "llama-sweep-bench"
    argv = list(fit.argv)
    assert argv[argv.index("--fit-margin") + 1] == "1024"          # no GPU to read free memory from: ik's default
    assert argv[argv.index("-c") + 1] == "512" and "-ot" not in argv and "-ngl" not in argv
    m = fit.measurement
    # the flags parsed (no "invalid argument"): ik got as far as its fit, which a CPU build cannot satisfy
    assert not m.ok and "Unable to auto-fit model" in m.error, m.error
    choice = parse_ik_fit(m.raw["log_tail"])
    assert choice is not None and choice.failed and sorted(choice.cpu_expert_layers) == list(range(6))
    assert fit.chosen_args == ()                                    # a failed fit placed nothing
    assert "unable to auto-fit" in fit.note


def test_ik_llama_bench_has_no_own_fit_we_use(ik_binaries, model):
    """ik's llama-bench --fit reserves KV for n_ctx_train (it never sets max_ctx_size): not a server's fit."""
    engine = LlamaCppEngine(ik_binaries["llama-bench"], timeout_s=120)
    assert engine.own_fit(load_inventory(model), BenchRun(16, 4, 0, 1), {"CUDA0": 1 << 30}) is None


def test_the_chosen_placement_is_ik_pattern_and_our_parser_reads_it(model):
    inv = load_inventory(model)
    log = ("Memory required for model tensors + cache: 900 MiB\n"
           "Memory available on all devices - compute: 600 MiB\n"
           "Adding experts CPU overrides for layer 5 in device 0\n"
           "Adding experts CPU overrides for layer 4 in device 0\n"
           "Memory use in device 0 is 590 MiB after adding 2 overrides, which is less than available memory "
           "of 600 MiB\n")
    choice = parse_ik_fit(log)
    assert choice == IkFitChoice(900, 600, (5, 4), ())
    plan = flag_plan(inv, list(choice.args()), Knobs(), "ik", "m")
    on_cpu = {n for n, d in plan.assignment.items() if d == "CPU"}
    assert on_cpu == {"token_embd.weight"} | {t.name for t in inv.allocated() if t.is_expert and t.layer in (4, 5)}
    assert parse_ik_fit("no fit here") is None
    assert IkFitChoice(10, 20, ()).args() == ("-ngl", "999")       # everything fitted


@pytest.mark.slow
def test_a_tune_study_on_ik_sweep_bench_stores_the_fit_baseline(ik_binaries, model, tmp_path, capsys):
    args = ["tune", str(model), "--engine", "llamacpp", "--llama-bench", str(ik_binaries["llama-sweep-bench"]),
            "--dialect", "ik", "--cpu-stand-in", "--gpu", "1GiB", "--keep-free", "0", "--trials", "2",
            "--n-prompt", "16", "--n-gen", "4", "--reps", "1", "--confirm", "2", "--objective", "both", "--study", "ik",
            "--storage", f"sqlite:///{tmp_path / 's.db'}", "--out", str(tmp_path / "report"), "--pool", "20",
            "--quiet", "--json"]
    assert main(args) == 0
    s = json.loads(capsys.readouterr().out)
    fit = next(b for b in s["baselines"] if b["kind"] == "engine-fit")
    assert fit["ok"] and fit["measured"]["tg_tps"] > 0 and "--fit" not in fit["argv"]    # the stand-in line
    assert fit["commands"]["llama-bench"].startswith("llama-sweep-bench ") and "CPU stand-in" in fit["note"]
    conf = s["confirmed"]
    assert conf["reference"] == "fit" and conf["results"][0]["key"] == "fit"
    assert all(len(r["tg"]["samples"]) == 2 for r in conf["results"])


def test_the_fit_run_holds_the_servers_context_in_whole_ubatches(ik_binaries, model):
    """ik's --fit is sized for depth + prompt + generated (what the trials are judged at); sweep-bench fails the
    row that crosses -c, so -c is whole ubatches (the H100 run at -c 2112 -ub 512 ended in llama_decode failed).
    The stand-in runs the same line without --fit: it must run to the end."""
    engine = LlamaCppEngine(ik_binaries["llama-sweep-bench"], timeout_s=300, cpu_stand_in=True)
    fit = engine.own_fit(load_inventory(model), BenchRun(600, 4, 0, 1), {"CUDA0": 1 << 30})
    argv = list(fit.argv)
    assert argv[argv.index("-c") + 1] == "1024" and argv[argv.index("-ub") + 1] == "512"
    assert fit.measurement.ok, fit.measurement.error
