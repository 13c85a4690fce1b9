"""ik_llama.cpp rules read from its source (8337e4cd; docs/ik_llama.md): the byte-based -ts split, -ncmoe over
several GPUs, builds and their flags, and what `plan --dialect ik` prints. Hand-checkable numbers first."""
from __future__ import annotations

import random
from dataclasses import replace

import pytest

from planner.builds import PINNED, Build, Feature, from_version, parse_build
from offload_tuner.app import commands_for
from planner.errors import InputError
from planner.flags import parse, render
from planner.flags.ik_split import ncmoe_spread, split_slots, tensor_split_for
from planner.loader import load_model
from planner.plan import Knobs, OffloadPolicy, OpRule, Plan

GPUS = ["CUDA0", "CUDA1"]


def test_ts_splits_cumulative_bytes_with_a_compute_reserve_per_gpu():
    # 4 blocks + output of 10 bytes each, compute reserve C = 5, -ts 1,1: S = 2*5 + 50 = 60, CUDA0 gets up to 30.
    # CUDA0: 5+10=15, 25 <= 30; 35 > 30 and overshoots 5, not less than the undershoot 5 -> stop: blocks 0-1.
    # CUDA1: 25+5=30, then 40, 50, 60 <= 60: blocks 2-3 and the output. (Counting layers, mainline gives 3/2.)
    assert split_slots(4, 99, GPUS, [1, 1], [10.0] * 5, 5.0) == ["CUDA0", "CUDA0", "CUDA1", "CUDA1", "CUDA1"]
    # a block that overshoots less than it undershoots is taken: C = 0, S = 50, CUDA0 up to 25 -> 10, 20, (30: +5
    # over vs 5 under: not less) ... with -ts 26,24 CUDA0 may hold 26: 30 is 4 over, 6 under -> taken
    assert split_slots(4, 99, GPUS, [26, 24], [10.0] * 5, 0.0)[:4] == ["CUDA0", "CUDA0", "CUDA0", "CUDA1"]


def test_blocks_no_gpu_takes_stay_on_the_last_gpu_and_ngl_limits_the_window():
    # -ngl 2: blocks 2-3 only; output on the CPU (ngl <= n_layer)
    assert split_slots(4, 2, GPUS, [1, 0], [10.0] * 5, 0.0) == ["CPU", "CPU", "CUDA0", "CUDA0", "CPU"]
    # -ts 0,1 -> splits [0, 1]: CUDA0 takes nothing (its budget is 0); the rest default to the last GPU
    assert split_slots(4, 99, GPUS, [0, 1], [10.0] * 5, 1.0) == ["CUDA1"] * 5


@pytest.mark.parametrize("seed", range(40))
def test_tensor_split_for_reproduces_any_counts(seed):
    rng = random.Random(seed)
    n_layer, n_dev = rng.randint(2, 40), rng.randint(2, 4)
    ngl = rng.randint(1, n_layer + 1)
    sizes = [float(rng.randint(1, 1 << 30)) for _ in range(n_layer + 1)]
    mc = float(rng.randint(0, 1 << 28))
    n_slots = min(ngl, n_layer) + (1 if ngl > n_layer else 0)
    cuts = sorted(rng.randint(0, n_slots) for _ in range(n_dev - 1))
    counts = [b - a for a, b in zip([0, *cuts], [*cuts, n_slots])]
    ts = tensor_split_for(counts, n_layer, ngl, sizes, mc)
    slots = split_slots(n_layer, ngl, [f"CUDA{i}" for i in range(n_dev)], ts, sizes, mc)
    gpu_slots = [s for s in slots if s != "CPU"]
    assert [gpu_slots.count(f"CUDA{i}") for i in range(n_dev)] == counts


def test_ncmoe_spread_shares_n_by_blocks_per_gpu_and_takes_each_gpus_last_blocks():
    # 48 blocks, CUDA0 0-23, CUDA1 24-47, N = 9: round(24/48*9) = round(4.5) = 5 each = 10 > 9; both are 0.5 over,
    # the first wins the tie (err > best strictly) -> CUDA0 4, CUDA1 5: blocks 20-23 and 43-47
    assert ncmoe_spread(9, [0] * 24 + [1] * 24, 2) == [20, 21, 22, 23, 43, 44, 45, 46, 47]
    # blocks below -ngl keep the last device: -ngl 4 of 8 -> counts [2, 6], N = 4 -> 1 and 3
    assert ncmoe_spread(4, [1, 1, 1, 1, 0, 0, 1, 1], 2) == [3, 5, 6, 7]


def test_issue_11_qwen3_two_gpus_ncmoe_9():
    # issue 11, item 3: -ngl 49 -ts 24,25 -ncmoe 9 puts the experts of blk 20-23 and 43-47 in RAM, not 39-47
    inv = load_model("preset:Qwen3-30B-A3B")
    p = parse("-ngl 49 -ts 24,25 -ncmoe 9 -c 8192", inv, "ik")
    in_ram = sorted({int(n.split(".")[1]) for n, d in p.assignment.items() if "_exps" in n and d == "CPU"})
    assert in_ram == [20, 21, 22, 23, 43, 44, 45, 46, 47]
    # build 4797-: one GPU rule for any GPU count, the first N layer indices before PR 2262, the last N MoE
    # layers after it (and before PR 1464/1466, build 4327, no spread over GPUs)
    old = parse("-ngl 49 -ts 24,25 -ncmoe 9 -c 8192", inv, "ik", build=Build("ik", 4326))
    assert sorted({int(n.split(".")[1]) for n, d in old.assignment.items() if "_exps" in n and d == "CPU"}) == \
        list(range(9))


def test_render_round_trips_two_gpu_ik_plans_through_the_byte_split():
    inv = load_model("preset:Qwen3-30B-A3B")
    base = parse("-ngl 49 -ts 24,25 -ncmoe 9 -c 8192", inv, "ik")
    plan = base.to_plan()
    for tool in ("server", "bench"):
        rc = render(plan, inv, tool)
        assert parse(rc, inv, "ik", tool=tool).assignment == plan.assignment


def test_builds_read_from_version_lines_and_options():
    assert from_version("version: 4840 (8337e4cd)\nbuilt with cc", "ik") == Build("ik", 4840, "version 4840 (8337e4cd)")
    assert from_version("version: 0 (unknown)", "mainline").number is None     # llama-cpp-python's vendored build
    assert parse_build(None, "ik") == PINNED["ik"] and parse_build("ik:3900", "ik").number == 3900
    with pytest.raises(InputError, match="--dialect ik"):
        parse_build("ik:3900", "mainline")
    assert PINNED["ik"].has(Feature.NCMOE_LAST_LAYERS) and not Build("ik", 4796).has(Feature.NCMOE_LAST_LAYERS)
    assert PINNED["mainline"].has(Feature.LOAD_MODE) and not Build("mainline", 9000).has(Feature.LOAD_MODE)


def _inv():
    return load_model("preset:Qwen3-30B-A3B")


def test_op_ids_follow_the_build():
    inv = _inv()
    a = parse("-ngl 99 -c 4096", inv, "ik").assignment
    moe_off = OffloadPolicy(moe_matmul=OpRule(False), moe_fused_up_gate=OpRule(False))
    plan = Plan("m", a, Knobs(offload=moe_off), "ik")
    op = lambda rc: rc[rc.index("-op") + 1]   # noqa: E731
    assert op(render(plan, inv)) == "28,0,31,0"                                # ggml.h since PR 741
    old = Plan("m", a, Knobs(offload=moe_off, only_active_experts=False), "ik")   # before PR 698: every expert
    assert op(render(old, inv, build=Build("ik", 3850))) == "28,0,30,0"        # PR 689 .. 741
    assert op(render(old, inv, build=Build("ik", 3700))) == "27,0,29,0"        # PR 405 .. 689
    dense_off = replace(old, knobs=replace(old.knobs, offload=replace(moe_off, dense_matmul=OpRule(False),
                                                                           output=OpRule(False))))
    assert op(render(dense_off, inv, build=Build("ik", 3850))) == "27,0,28,0,30,0"   # MUL_MAT is 27 there


def test_old_builds_get_the_flags_they_accept():
    inv = _inv()
    a = parse("-ngl 99 -c 4096", inv, "ik").assignment
    plan = Plan("m", a, Knobs(), "ik")
    # before PR 842 only-active-experts was off by default and -ooae turned it on; llama-bench had no switch
    assert "-ooae" in render(plan, inv, build=Build("ik", 3900))
    assert "-ooae" not in render(plan, inv) and "-no-ooae" not in render(plan, inv)
    with pytest.raises(InputError, match="PR 842"):
        render(plan, inv, "bench", build=Build("ik", 3900))
    # mainline before PR 20834: --no-mmap / -mmp 0 instead of -lm none
    ml = Plan("m", parse("-ngl 99 -c 4096 -fit off", inv, "mainline").assignment, Knobs(mmap=False), "mainline")
    assert "--no-mmap" in render(ml, inv, build=Build("mainline", 9000))
    assert render(ml, inv, "bench", build=Build("mainline", 9000))[-2:] == ["-mmp", "0"]
    assert "-lm" in render(ml, inv) and "--no-mmap" not in render(ml, inv)


def test_ik_never_renders_ngl_0_with_gpu_tensors():
    # everything on the CPU but the output layer: -ngl 0 would drop the -ot, so ik gets -ngl >= 1
    inv = _inv()
    a = {n: "CPU" for n in parse("-ngl 0 -c 4096", inv, "ik").assignment}
    a["output.weight"] = "CUDA0"
    rc = render(Plan("m", a, Knobs(), "ik"), inv)
    assert rc[rc.index("-ngl") + 1] != "0"
    assert parse(rc, inv, "ik").assignment == a


def test_plan_prints_server_lines_when_llama_bench_cannot_say_op():
    # issue 11, item 2: a plan with MoE offload off; ik's llama-bench has no -op
    inv = _inv()
    a = parse("-ngl 99 -ot exps=CPU -c 4096", inv, "ik").assignment
    off = OffloadPolicy(moe_matmul=OpRule(False), moe_fused_up_gate=OpRule(False))
    cmds = commands_for(Plan("m", a, Knobs(offload=off), "ik"), inv, "preset:Qwen3-30B-A3B")
    assert {"llama-server", "llama-cli", "llama-sweep-bench"} <= set(cmds.lines)
    assert "-op 28,0,31,0" in cmds.lines["llama-server"]
    assert "no -op" in cmds.cannot["llama-bench"]


def test_deepseek_v3_on_one_24gib_gpu_plans_the_ik_way(capsys):
    # issue 11, item 1: MLA, fused MoE (ik's default), -amb 512, experts in RAM with -ot ...=CPU
    from offload_tuner.cli import main
    assert main(["plan", "preset:DeepSeek-V3", "--gpu", "24GiB", "--dialect", "ik"]) == 0
    out = capsys.readouterr().out
    server = next(line for line in out.splitlines() if line.strip().startswith("llama-server "))
    assert "-mla 3" in server and "-amb 512" in server and "exps=CPU" in server
    assert "-ngl 0 " not in server and "-fmoe" not in server     # ik's server only knows -no-fmoe


def test_plan_for_an_older_ik_build_uses_its_flags(capsys):
    # build 3850: op ids of PR 689 (no FUSED_UP_GATE yet), -ts by layer counts (before PR 1466), every expert
    # uploaded (before PR 698): no -ooae / -no-ooae at all
    from offload_tuner.cli import main
    assert main(["plan", "preset:gpt-oss-120b", "--gpu", "24GiB,24GiB", "--dialect", "ik", "--build", "ik:3850"]) == 0
    out = capsys.readouterr().out
    server = next(line for line in out.splitlines() if line.strip().startswith("llama-server "))
    # whether this plan turns op offload off is a tie (ik offloads gpt-oss's MoE ops only from ubatch
    # 32 * 128 / 4 = 1024, so at -ub 512 on and off predict the same): build 3850's -op ids are checked in
    # test_op_ids_follow_the_build
    assert "-ts 18,19" in server and "ooae" not in server
    assert "target:   ik build 3850" in out


def test_llama_bench_n_cpu_moe_acts_where_it_stands_among_the_ot_options():
    # examples/llama-bench add_cpu_buft_overrides appends to the same list as -ot, in command-line order;
    # the server appends -ncmoe after every -ot instead
    inv = _inv()
    first = parse([*["-ngl", "99", "--n-cpu-moe", "2", "-ot"], r"blk\.1\.ffn_up_exps=CUDA0"], inv, "ik", tool="bench")
    assert first.assignment["blk.1.ffn_up_exps.weight"] == "CPU"          # blk 1's pattern matched first
    after = parse([*["-ngl", "99", "-ot"], r"blk\.1\.ffn_up_exps=CUDA0", "--n-cpu-moe", "2"], inv, "ik", tool="bench")
    assert after.assignment["blk.1.ffn_up_exps.weight"] == "CUDA0"
    server = parse([*["-ngl", "99", "-ncmoe", "48", "-ot"], r"blk\.1\.ffn_up_exps=CUDA0"], inv, "ik")
    assert server.assignment["blk.1.ffn_up_exps.weight"] == "CUDA0"       # the -ot wins wherever it stands


def test_the_bench_line_spells_the_servers_ncmoe_as_explicit_ot():
    # server -ncmoe 10 = the LAST 10 MoE layers; llama-bench's --n-cpu-moe 10 would be the FIRST 10
    inv = _inv()
    plan = parse("llama-server -ngl 99 -ncmoe 10 -c 8192", inv, "ik").to_plan()
    bench = render(plan, inv, "bench")
    assert "--n-cpu-moe" not in bench and bench[bench.index("-ot") + 1] == \
        r"blk\.(3[89]|4[0-7])\.ffn_(down|gate|up)_exps=CPU"
    assert parse(bench, inv, "ik", tool="bench").assignment == plan.assignment


def test_a_model_without_mla_gets_no_mla_flags():
    """Issue 'first hour' 6: ik plans of Qwen3 carried `-mla 3 -amb 0`. -mla means nothing without MLA, and -amb
    bounds only attention without flash attention, so they are left out there (and read back as moot)."""
    from planner.flags import render
    from planner.loader import load_model
    from planner.plan import Knobs, Plan
    qwen, ds = load_model("preset:Qwen3-30B-A3B:Q4_K_M"), load_model("preset:DeepSeek-V3")

    def line(inv, **knobs) -> list[str]:
        plan = Plan(inv.source or inv.name, {t.name: "CPU" for t in inv.allocated()}, Knobs(**knobs), "ik")
        return list(render(plan, inv, "server"))
    assert "-mla" not in line(qwen) and "-amb" not in line(qwen)
    no_fa = line(qwen, flash_attn=False)
    assert "-mla" not in no_fa and no_fa[no_fa.index("-amb") + 1] == "0"       # -amb bounds non-FA attention
    mla = line(ds, amb=512)
    assert mla[mla.index("-mla") + 1] == "3" and mla[mla.index("-amb") + 1] == "512"
