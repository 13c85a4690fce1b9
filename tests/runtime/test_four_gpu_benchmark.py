"""benchmarks/four_gpu.py (issue 30): its four-GPU plans of the Qwen3-235B-A22B-shaped model render for llama-bench
and parse back to the same placement on four GPUs, each predicted to fit an 80 GB card (the machine the plans run
on), the planner's plans for cards of different sizes among them; its --cpu dry run measures, reports and resumes."""
from __future__ import annotations

import json

import pytest

from planner.flags import parse, render
from planner.hardware import GiB, load_hardware
from planner.engine_contract import BenchRun
from runtime.llamacpp import bench_memory

WL = BenchRun(2048, 32, 0, 1)


@pytest.fixture
def bench(bench_script):
    return bench_script("four_gpu")


def test_four_gpu_plans_fit_80_gb_cards_and_round_trip(bench):
    from planner.archs import build_inventory
    from planner.presets import load_preset
    from runtime.synth import uniform_recipe
    inv = build_inventory(load_preset(bench.PRESET).spec, uniform_recipe(bench.lg.QUANT), name="synthetic",
                          source=str(bench.MODEL_REL))
    assert inv.total_bytes() > 110 * GiB            # no single card holds it: several GPUs are needed
    hw = load_hardware("gpu-box").with_vram([80 * GiB] * 4)
    cases = bench.make_cases(inv, hw, WL.n_prompt)
    names = [c.name for c in cases]
    assert len(cases) >= 13 and len(set(names)) == len(names)
    assert {"planner-4x16G", "planner-4x24G", "planner-24-16-16-8G", "exps-next-gpu"} <= set(names)
    for c in cases:
        args = list(render(c.plan, inv, "bench", bench=WL, model_path="model.gguf"))
        back = parse(args, inv, "mainline", tool="bench", n_gpus=4)
        assert back.assignment == c.plan.assignment, c.name
        pred = bench_memory(inv, c.plan, WL, hw).devices
        used = [d for d in bench.GPUS if d in pred and pred[d].total > 0]
        assert len(used) == 4, c.name
        assert max(pred[d].total for d in used) < 76 * GiB, c.name     # an H100's 80 GB less the driver's
    by = {c.name: c.plan for c in cases}
    assert by["attn0-exps-spread-out3"].assignment["output.weight"] == "CUDA3"
    # the planner's plan for mixed cards: the 8 GiB card holds the least, inside its budget
    mixed = bench_memory(inv, by["planner-24-16-16-8G"], WL, hw.with_vram([b * GiB for b in (24, 16, 16, 8)])).devices
    assert mixed["CUDA3"].total <= 8 * GiB and mixed["CUDA0"].total > mixed["CUDA3"].total


@pytest.mark.slow
@pytest.mark.llamacpp
def test_four_gpu_dry_run_reports_and_resumes(bench, llama_bench, tmp_path):
    work, out = tmp_path / "work", tmp_path / "out"
    argv = ["--cpu", "--workdir", str(work), "--out", str(out), "--name", "fg",
            "--plans", "ts-1-1-1-1,exps-next-gpu,planner-4x1G"]
    assert bench.main(argv) == 0
    rep = json.loads((out / "fg.json").read_text())
    plans = {p["name"]: p for p in rep["memory"]}
    assert set(plans) == {"ts-1-1-1-1", "exps-next-gpu", "planner-4x1G"}
    for p in plans.values():
        assert p["measurement"]["ok"] and p["predicted_devices"] == list(bench.GPUS)
        assert all(r["predicted_mib"] > 0 and r["measured_mib"] is None for r in p["devices"].values())
    assert rep["summary"]["plans"] == 3 and rep["summary"]["plans_measured"] == 0      # CPU: predicted only
    md = (out / "fg.md").read_text()
    assert "| exps-next-gpu |" in md and "CUDA3 measured" in md
    mtime = (work / "results" / "plan-ts-1-1-1-1.json").stat().st_mtime_ns
    assert bench.main(argv) == 0                                  # resumed: nothing measured again
    assert (work / "results" / "plan-ts-1-1-1-1.json").stat().st_mtime_ns == mtime
    assert bench.main([*argv[:-2], "--plans", "nope"]) == 2


def test_four_gpu_report_only_rewrites_the_h100x4_report(bench, tmp_path):
    """The committed four-H100 run, its state unpacked as a fresh machine would: --report-only rewrites the report
    (table, figure) from the results with the machine's meta, running nothing; a file that is no report: exit 2."""
    import tarfile
    reported = bench.ROOT / "benchmarks" / "reported"
    work, out = tmp_path / "work", tmp_path / "out"
    with tarfile.open(reported / "multi_gpu_h100x4_state.tar.gz") as tar:
        tar.extractall(work, filter="data")
    argv = ["--workdir", str(work), "--out", str(out), "--name", "r"]
    assert bench.main([*argv, "--report-only", str(reported / "multi_gpu_h100x4.json")]) == 0
    rep = json.loads((out / "r.json").read_text())
    assert rep["summary"]["plans_within_goal"] == rep["summary"]["plans_measured"] == 14
    assert rep["summary"]["gpu_rows_within_goal"] == 56 and rep["meta"]["gpu"].count("H100") == 4
    assert "![memory per GPU](r.png)" in (out / "r.md").read_text() and (out / "r.png").stat().st_size > 10_000
    (tmp_path / "bad.json").write_text("[]")
    assert bench.main([*argv, "--report-only", str(tmp_path / "bad.json")]) == 2
