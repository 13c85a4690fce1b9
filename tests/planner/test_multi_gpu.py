"""Two GPUs (issue 15) in the planner: a baseline's command line without -ts spreads over the machine's GPUs, the best
hand `-ncmoe N -ts a,b` balances them, a two-GPU study measures it and confirms it beside --fit without picking it,
and llama.cpp's pipeline parallelism (several GPUs, every layer offloaded, no override) keeps four copies of each
graph input in the compute buffers."""
from __future__ import annotations

from dataclasses import replace

import pytest

from planner.flags import parse
from planner.hardware import GiB, MiB, load_hardware
from planner.memory import SCHED_MAX_COPIES, compute_bytes, estimate, pipeline_copies
from planner.plan import Knobs, Plan
from planner.presets import load_preset
from planner.propose import Room
from planner.engine_contract import Engine
from tuner.baselines import flag_plan, ncmoe_split

MODEL = "Qwen3-30B-A3B:Q4_K_M"
KNOBS = Knobs(n_ctx=2112, n_batch=512, n_ubatch=512, n_threads=16)


@pytest.fixture(scope="module")
def inv():
    return load_preset(MODEL).inventory()


def two(gib: int):
    return load_hardware("gpu-box").with_vram([gib * GiB, gib * GiB])


def gpus_of(plan: Plan) -> set[str]:
    return {d for d in plan.assignment.values() if d != "CPU"}


def test_a_baseline_line_without_ts_spreads_over_the_machines_gpus(inv):
    one = flag_plan(inv, ["-ngl", "99", "-cmoe"], KNOBS, "mainline", "m")
    both = flag_plan(inv, ["-ngl", "99", "-cmoe"], KNOBS, "mainline", "m", n_gpus=2)
    assert gpus_of(one) == {"CUDA0"}                      # what the line alone says: one GPU
    assert gpus_of(both) == {"CUDA0", "CUDA1"}            # on two GPUs llama.cpp splits the layers over both
    # as llama.cpp does with equal free memory: the first 25 of 49 slots on CUDA0, the rest and the output on CUDA1
    assert both.assignment["blk.24.attn_norm.weight"] == "CUDA0"
    assert both.assignment["blk.25.attn_norm.weight"] == "CUDA1"
    assert both.assignment["output.weight"] == "CUDA1"


@pytest.mark.slow
def test_the_best_hand_ncmoe_ts_balances_the_two_gpus(inv):
    hw = two(8)
    budget = Room.from_hardware(hw, 256 * MiB).gpus

    def headroom(plan: Plan) -> int:
        mem = estimate(inv, plan, hw)
        return min(b - mem.gpu_total(g) for g, b in budget.items())

    n, ts = ncmoe_split(inv, KNOBS, "mainline", "m", headroom, 2)
    assert sum(ts) == inv.n_layer + 1 and ts[0] > ts[1]   # mainline's -ncmoe N empties CUDA0 first: more layers there
    plan = flag_plan(inv, ["-ngl", "99", "-ncmoe", str(n), "-ts", f"{ts[0]},{ts[1]}"], KNOBS, "mainline", "m", 2)
    assert headroom(plan) >= 0
    even = flag_plan(inv, ["-ngl", "99", "-ncmoe", str(n)], KNOBS, "mainline", "m", 2)
    assert estimate(inv, even, hw).gpu_total("CUDA1") > budget["CUDA1"]    # the even split does not fit at that N
    # and no split fits one -ncmoe less: N is the smallest
    for a in range(1, inv.n_layer + 1):
        fewer = flag_plan(inv, ["-ngl", "99", "-ncmoe", str(n - 1), "-ts", f"{a},{inv.n_layer + 1 - a}"], KNOBS,
                          "mainline", "m", 2)
        assert headroom(fewer) < 0
    assert ncmoe_split(inv, KNOBS, "mainline", "m", headroom, 2, start=n + 1)[0] == n + 1
    # nothing fits: not even every expert in RAM
    assert ncmoe_split(inv, KNOBS, "mainline", "m", lambda p: -1, 2) is None


def test_pipeline_parallelism_only_on_several_gpus_with_every_layer_and_no_override(inv, monkeypatch):
    def plan(args: list[str], **kn) -> Plan:
        pc = parse(args, inv, "mainline", tool="bench", n_gpus=2)
        return Plan("m", pc.assignment, replace(KNOBS, **kn))
    split = plan(["-ngl", "99", "-ts", "1/1"])
    assert pipeline_copies(inv, split) == SCHED_MAX_COPIES["mainline"] == 4
    assert pipeline_copies(inv, replace(split, dialect="ik")) == 1      # ik builds with GGML_SCHED_MAX_COPIES=1
    assert pipeline_copies(inv, plan(["-ngl", "99", "-ts", "1/1", "-ncmoe", "2"])) == 1      # an override
    assert pipeline_copies(inv, plan(["-ngl", "48", "-ts", "1/1"])) == 1                     # output layer in RAM
    assert pipeline_copies(inv, plan(["-ngl", "99", "-ts", "1/0"])) == 1                     # one GPU
    assert pipeline_copies(inv, plan(["-ngl", "99", "-ts", "1/1"], no_kv_offload=True)) == 1
    # four copies of each split input, never freed: at least 3 more of the residual stream each GPU receives
    four = compute_bytes(inv, split)
    import planner.memory as memory
    monkeypatch.setattr(memory, "pipeline_copies", lambda inv, plan: 1)
    one = compute_bytes(inv, split)
    act = inv.hparams.n_embd * KNOBS.n_ubatch * 4
    assert four["CUDA0"] >= one["CUDA0"] + 3 * act            # CUDA0 receives the embeddings from the CPU
    assert four["CUDA1"] >= one["CUDA1"] + 3 * act            # CUDA1 the residual stream from CUDA0
    assert four["CPU"] >= one["CPU"] + 3 * act                # the graph inputs (the unused embeddings input too)


class _Recording(Engine):
    """The sim engine, recording what it ran."""
    name = "sim-rec"

    def __init__(self, hw):
        from runtime.sim import SimEngine
        self.sim, self.plans = SimEngine(hw), []

    def measure(self, inv, plan, workload):
        self.plans.append(plan)
        return self.sim.measure(inv, plan, workload)


@pytest.mark.slow
def test_a_two_gpu_study_measures_and_confirms_the_ncmoe_ts_line_beside_fit(inv):
    from tuner.search import Tuner, StudyConfig, BenchRun
    hw = two(8)
    engine = _Recording(hw)
    tuner = Tuner(inv, hw, engine, StudyConfig(
        objective="both", bench=BenchRun(2048, 64, 0, 1), n_ctx=2112, storage=None, pool_size=30, seed=1))
    base = {b["kind"]: b for b in tuner.baselines()}
    nc = base["ncmoe"]
    assert nc["ok"] and "-ts" in nc["name"] and nc["ts"] and sum(nc["ts"]) == inv.n_layer + 1
    assert gpus_of(Plan.from_json(nc["plan"])) == {"CUDA0", "CUDA1"}
    assert "-ts" in nc["commands"]["llama-server"]
    assert gpus_of(engine.plans[[p.label for p in engine.plans].index("-ngl 99 -cmoe")]) == {"CUDA0", "CUDA1"}
    tuner.run(3)
    keys = [c.key for c in tuner.finalists(1, ncmoe=True)]
    assert keys[0] == "fit" and "ncmoe" in keys and "ncmoe" not in [c.key for c in tuner.finalists(1)]
    rec = tuner.confirm(2, n_tg=1, ncmoe=True)
    assert "ncmoe" not in rec["picks"].values()                     # a baseline gets ratios, never a pick
    row = next(r for r in rec["results"] if r["key"] == "ncmoe")
    assert row["tg_vs_fit"] is not None and set(row["vram_device_bytes"]) == {"CUDA0", "CUDA1"}
    assert all(v <= 8 * GiB for v in row["vram_device_bytes"].values())


def test_filling_two_gpus_with_experts_keeps_each_within_its_budget(inv):
    """fill_experts adds each move's bytes to a starting estimate, an upper bound on one GPU only: on two, a CUDA1
    layer's experts moved home take their prompt compute from CUDA0 (op offload's GPU) to CUDA1. The 'last' fill
    at 2x8 GiB came out 6 MiB over CUDA1's budget; the whole estimate now undoes the last move there."""
    from planner.propose import proposals
    hw = two(8)
    budget = Room.from_hardware(hw, 0)
    fills = [p for p in proposals(inv, hw, KNOBS, "mainline", 0) if p.strategy == "experts-cpu+fill"]
    assert {p.order for p in fills} >= {"first", "last"}
    for p in fills:
        mem = estimate(inv, p.plan, hw)
        assert budget.fits(mem), (p.order, {d: m.total // MiB for d, m in mem.devices.items()})
        assert mem.gpu_total("CUDA1") > budget.gpus["CUDA1"] - 512 * MiB      # and still nearly full
