"""benchmarks/multi_gpu.py (issue 15): its two-GPU plans render for llama-bench and parse back to the same placement
on two GPUs (-ts, =CUDA1 in -ot, -ncmoe), and its --cpu dry run goes through the whole pipeline (memory table per
device, the torch runtime's placements on two logical GPUs, the 2x budget cell with --fit, the -ncmoe -ts line and a
study confirmed together) on the CPU build, every llama.cpp plan all-CPU; a second call resumes with nothing left,
and so does a fresh folder made from the state tarball. The torch step alone needs no llama.cpp: its dry run
(every plan predicted by the engine's own memory model and measured on two logical GPUs: the same bytes; weights
and KV per device as planner.memory places them)
runs with the fast tests."""
from __future__ import annotations

import json
import shutil
import tarfile

import pytest

from planner.flags import parse, render
from planner.hardware import GiB, load_hardware
from planner.memory import pipeline_copies
from planner.engine_contract import BenchRun
from runtime.llamacpp import bench_memory

WL = BenchRun(2048, 32, 0, 1)


@pytest.fixture
def bench(bench_script):
    return bench_script("multi_gpu")


def synthetic(bench):
    """The inventory of the 17 GB model the benchmark writes (no file needed)."""
    from planner.archs import build_inventory
    from planner.presets import load_preset
    from runtime.synth import uniform_recipe
    lg = bench.lg
    return build_inventory(load_preset(lg.PRESET).spec, uniform_recipe(lg.QUANT), name="synthetic",
                           source="benchmarks/results/llamacpp_gpu/qwen3-30b-a3b-q4_0.gguf")


def test_two_gpu_plans_render_for_llama_bench_and_parse_back_on_two_gpus(bench):
    inv = synthetic(bench)
    hw = load_hardware("gpu-box").with_vram([141 * GiB, 141 * GiB])
    cases = bench.make_cases(inv, hw, [8, 16], WL.n_prompt)
    names = [c.name for c in cases]
    assert len(cases) >= 10 and len(set(names)) == len(names)
    assert {"ts-1-1", "ts-3-1", "ts-1-3", "exps-crossed", "attn0-exps1-out1", "planner-2x8G", "planner-2x16G"} <= \
        set(names)
    for c in cases:
        plan = c.plan
        assert {d for d in plan.assignment.values() if d != "CPU"} == {"CUDA0", "CUDA1"}, c.name
        args = list(render(plan, inv, "bench", bench=WL, model_path="model.gguf"))
        ts = args[args.index("-ts") + 1]
        assert "/" in ts and "," not in ts, c.name            # llama-bench: '/' inside one split, ',' between runs
        back = parse(args, inv, "mainline", tool="bench", n_gpus=2)
        assert back.n_gpus == 2 and back.assignment == plan.assignment, c.name
        assert (back.knobs.n_ubatch, back.knobs.offload) == (plan.knobs.n_ubatch, plan.knobs.offload), c.name
        pred = bench_memory(inv, plan, WL, hw).devices
        assert pred["CUDA0"].total > 0 and pred["CUDA1"].total > 0, c.name
        ot = args[args.index("-ot") + 1] if "-ot" in args else ""
        if c.name == "exps-crossed":
            assert "=CUDA0" in ot and "=CUDA1" in ot
        if c.name == "attn0-exps1-out1":
            assert "=CUDA1" in ot and ts == f"{inv.n_layer}/1" and plan.assignment["output.weight"] == "CUDA1"
            assert all(plan.assignment[f"blk.{i}.attn_norm.weight"] == "CUDA0" for i in range(inv.n_layer))
        if c.name.startswith("ncmoe"):
            assert "-ncmoe" in args
    by = {c.name: c for c in cases}
    assert pipeline_copies(inv, by["ts-1-1"].plan) == 4 and pipeline_copies(inv, by["exps-crossed"].plan) == 1
    # the hand-balanced -ncmoe split puts more layers on CUDA0 than -ts 1,1 does
    nc = [n for n in names if n.startswith("ncmoe") and not n.endswith("-ts-1-1")][0]
    a0 = sum(1 for i in range(inv.n_layer) if by[nc].plan.assignment[f"blk.{i}.attn_norm.weight"] == "CUDA0")
    assert a0 > (inv.n_layer + 1) // 2 + 1


def test_torch_plans_are_two_device_placements_of_the_cut_qwen3_shape(bench):
    inv = bench.torch_inventory(bench.TORCH_LAYERS)
    from planner.presets import load_preset
    preset = load_preset(bench.TORCH_PRESET).inventory()
    assert inv.n_layer == 16 and 19 * GiB < inv.total_bytes() < 20.5 * GiB
    # the same layers as the 48-layer model (and the llama.cpp step's): staging, KV and logits at their real sizes
    assert [(t.name, t.shape, t.ggml_type) for t in inv.allocated() if t.layer in (None, 0, 15)] == \
        [(t.name, t.shape, t.ggml_type) for t in preset.allocated() if t.layer in (None, 0, 15)]
    hw = bench.torch_hardware(bench.TORCH_HARDWARE)
    assert hw.name == "calibrated" and len(hw.gpus) == 2      # torch_study.py's profile, two GPUs
    cases = bench.torch_cases(inv, hw, list(bench.TORCH_BUDGETS), WL)
    names = [c.name for c in cases]
    assert len(cases) >= 10 and len(set(names)) == len(names)
    assert {"ts-1-1", "ts-1-3", "exps-crossed", "attn0-exps1-out1", "cmoe-ts-1-1", "planner-2x4G",
            "planner-2x8G"} <= set(names)
    for c in cases:
        assert {d for d in c.plan.assignment.values() if d != "CPU"} == {"CUDA0", "CUDA1"}, c.name
        assert c.plan.knobs.n_ctx == 2304           # 2048 + 32 tokens rounded up to 256: the engine's KV cells too
    by = {c.name: c for c in cases}
    assert by["attn0-exps1-out1"].plan.assignment["output.weight"] == "CUDA1"
    assert all(d == "CPU" for n, d in by["cmoe-ts-1-1"].plan.assignment.items() if "_exps." in n)


def _torch_dry_run(bench, work, out, *more):
    return bench.main(["--cpu", "--steps", "torch,report", "--workdir", str(work), "--out", str(out), "--name", "mg",
                       *more])


@pytest.mark.slow
def test_torch_step_dry_run_on_two_logical_gpus_resumes(bench, tmp_path):
    work, out = tmp_path / "work", tmp_path / "out"
    assert _torch_dry_run(bench, work, out) == 0          # no llama-bench needed for the torch step
    rep = json.loads((out / "mg.json").read_text())
    plans = {p["name"]: p for p in rep["torch"]}
    assert len(plans) >= 10 and rep["torch_summary"]["plans"] == len(plans) and rep["memory"] == []
    assert rep["torch_summary"]["device_checks"] == 2 * len(plans)
    for p in plans.values():
        assert p["measurement"]["ok"] and p["logical_gpus"], p["name"]
        assert p["predicted_devices"] == ["CUDA0", "CUDA1"]
        for d in ("CUDA0", "CUDA1"):
            r, pred = p["devices"][d], p["predicted"][d]
            assert r["measured_bytes"] > 0 and r["within_goal"] is not None, (p["name"], d)
            # predicted by the engine's own memory model (its dry-run accountant): on a logical GPU (no CUDA
            # context) the accountant's peak, byte for byte
            assert p["memory_model"].startswith("torch engine") and pred["overhead"] == 0
            assert r["context_excluded"] and r["predicted_bytes"] == pred["total"] == r["measured_bytes"] > 0
            e = r["engine_parts"]
            # the two-device placement agrees with planner.memory tensor for tensor: weights and KV per device
            llama = p["predicted_planner_memory"][d]
            assert (e["weights"], e["kv"]) == (pred["weights"], pred["kv"]) == (llama["weights"], llama["kv"]), \
                (p["name"], d)
            assert e["context"] == 0 and e["activations"] >= 0
            assert e["weights"] + e["kv"] + e["staging"] + e["activations"] == r["measured_bytes"]
    # op offload stages the RAM experts on the first GPU only; without it nothing is staged
    cm = plans["cmoe-ts-1-1"]["devices"]
    assert cm["CUDA0"]["engine_parts"]["staging"] > 0 and cm["CUDA1"]["engine_parts"]["staging"] == 0
    assert plans["cmoe-ts-1-1-nopo"]["devices"]["CUDA0"]["engine_parts"]["staging"] == 0
    md = (out / "mg.md").read_text()
    assert "## Torch runtime: predicted vs measured per device" in md and "| cmoe-ts-1-1 |" in md
    assert "two logical GPUs" in md and "per-GPU peaks within the goal" in md.split("## Torch runtime")[1]
    assert "the torch engine's own memory model" in md
    # the steps not run say so in a line, not as empty tables
    assert "Not run in the calls of this report (no memory step)." in md and "0 of 0" not in md
    assert "Not run in the calls of this report (no tune step)." in md
    # resumed: nothing measured again; a fresh folder from the state tarball neither
    res = work / "results" / "torch-ts-1-1.json"
    mtime = res.stat().st_mtime_ns
    assert _torch_dry_run(bench, work, out) == 0 and res.stat().st_mtime_ns == mtime
    state = out / "mg_state.tar.gz"
    with tarfile.open(state) as tar:
        assert "results/torch-ts-1-1.json" in tar.getnames()
    shutil.rmtree(work)
    work.mkdir()
    with tarfile.open(state) as tar:
        tar.extractall(work)
    mtime = res.stat().st_mtime_ns
    assert _torch_dry_run(bench, work, out) == 0 and res.stat().st_mtime_ns == mtime
    assert len(json.loads((out / "mg.json").read_text())["torch"]) == len(plans)
    # a plan whose process died twice while measuring it is recorded as failed, not retried forever
    (work / "results" / "torch-ts-1-3.json").unlink()
    (work / "results" / "torchrun-ts-1-3.json").write_text('{"attempts": 2}')
    assert _torch_dry_run(bench, work, out) == 0
    failed = json.loads((work / "results" / "torch-ts-1-3.json").read_text())
    assert not failed["measurement"]["ok"] and "died" in failed["measurement"]["error"]
    assert not (work / "results" / "torchrun-ts-1-3.json").exists()
    assert "FAILED" in (out / "mg.md").read_text()


@pytest.mark.slow
@pytest.mark.llamacpp
def test_multi_gpu_benchmark_dry_run(bench, llama_bench, tmp_path):
    work, out = tmp_path / "work", tmp_path / "out"
    argv = ["--cpu", "--workdir", str(work), "--out", str(out), "--name", "mg", "--runs", "17", "--pool", "20",
            "--plans", "ts-1-1,ts-3-1,ncmoe2-ts-1-1,exps-crossed,attn0-exps1-out1,cmoe-ts-1-1,"
                       "half-exps-ram-ts-1-1-ub2048,planner-2x1G", "--torch-plans", "ts-1-1,cmoe-ts-1-1,planner-2x1G"]
    assert bench.main(argv) == 0
    rep = json.loads((out / "mg.json").read_text())
    # the torch step ran between memory and tune (in a child process: tune's llama.cpp runs get clean GPUs)
    assert [p["name"] for p in rep["torch"]] == ["ts-1-1", "cmoe-ts-1-1", "planner-2x1G"]
    assert all(p["measurement"]["ok"] and p["logical_gpus"] and p["within_goal"] is not None for p in rep["torch"])
    assert rep["meta"]["binary"] and not (work / "call_meta.json").exists()
    assert rep["meta"]["cpu_mode"] and rep["meta"]["hardware"] == "gpu-box x2"
    plans = {p["name"]: p for p in rep["memory"]}
    assert len(plans) == 8 and all(p["measurement"]["ok"] for p in plans.values())
    for p in plans.values():
        assert p["predicted_devices"] == ["CUDA0", "CUDA1"]           # predicted with two devices
        assert "-ts" in p["flags"] and "CUDA" not in p["ran"]                  # ran all-CPU
        for d in ("CUDA0", "CUDA1"):
            r = p["devices"][d]
            assert r["predicted_mib"] > 0 and r["measured_mib"] is None and r["within_goal"] is None
            assert set(r["predicted_parts"]) == {"weights", "kv", "compute", "overhead"}
        assert p["within_goal"] is None
    assert plans["ts-1-1"]["pipeline_copies"] == 4 and plans["ts-1-1"]["pipeline_parallel_logged"] is False
    assert "=CUDA1" in plans["exps-crossed"]["flags"] and "=CUDA1" in plans["attn0-exps1-out1"]["flags"]
    assert rep["memory_summary"]["plans"] == 8
    [row] = rep["budgets"]
    assert row["budget_gib_per_gpu"] == 1 and row["budgets_gib"] == [1, 1] and row["confirmed"] and row["runs"] <= 17
    assert row["engine_runs"]["trials"] >= 1
    for role in ("fit", "best_tg", "ncmoe_ts"):
        assert {"tg", "pp", "vram_mib_by_device", "flags"} <= set(row[role]), role
    assert "-ts" in row["ncmoe_ts"]["flags"] and row["ncmoe_ts"]["ts"] and not row["ncmoe_ts"].get("unconfirmed")
    assert row["fit"]["flags"] and row["ratios"]["best_tg"]["tg"] is not None
    assert row["ratios"]["ncmoe_ts"]["tg"] is not None and row["ratios"]["ncmoe_ts"]["pp"] is not None
    md = (out / "mg.md").read_text()
    assert "## Memory per device" in md and "| ts-1-1 |" in md and "| 2x1 GiB | best -ncmoe N -ts a,b |" in md
    assert md.index("## Memory per device") < md.index("## Torch runtime") < md.index("## Budgets per GPU")
    # resumed: nothing left to run
    mtime = (work / "results" / "plan-ts-1-1.json").stat().st_mtime_ns
    assert bench.main(argv) == 0
    assert (work / "results" / "plan-ts-1-1.json").stat().st_mtime_ns == mtime
    # a fresh machine: the state tarball alone (the model is written again) has nothing left to run either
    state = out / "mg_state.tar.gz"
    with tarfile.open(state) as tar:
        members = tar.getnames()
    assert "multi_gpu.db" in members and "results/plan-ts-1-1.json" in members
    assert "results/torch-cmoe-ts-1-1.json" in members
    assert not any(m.endswith(".gguf") for m in members)
    shutil.rmtree(work)
    work.mkdir()
    with tarfile.open(state) as tar:
        tar.extractall(work)
    assert bench.main(argv) == 0
    assert json.loads((out / "mg.json").read_text())["budgets"][0]["runs"] == row["runs"]


def test_report_step_rewrites_the_h100x2_report_with_its_figure(bench, tmp_path):
    """The committed two-H100 torch run, its state unpacked as a fresh machine would: --steps report rewrites the
    report from the results (28 GPU rows within the goal) and draws each GPU's share and error per plan."""
    import tarfile
    reported = bench.ROOT / "benchmarks" / "reported"
    work, out = tmp_path / "work", tmp_path / "out"
    with tarfile.open(reported / "multi_gpu_h100x2_state.tar.gz") as tar:
        tar.extractall(work, filter="data")
    assert bench.main(["--steps", "report", "--workdir", str(work), "--out", str(out), "--name", "r"]) == 0
    rep = json.loads((out / "r.json").read_text())
    assert rep["torch_summary"]["device_checks_within_goal"] == rep["torch_summary"]["device_checks"] == 28
    assert "![memory per GPU](r.png)" in (out / "r.md").read_text() and (out / "r.png").stat().st_size > 10_000
