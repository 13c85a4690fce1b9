"""Hand-checked cases for planner.flags: -ngl slots, -ot first match, -cmoe/-ncmoe, -ts, errors and warnings.

The tiny model (built here with archs.build_inventory): qwen3moe, 4 blocks, block 0 without experts (qwen3moe's
layer table has no dense FFN, so attention and norms only), blocks 1-3 MoE (ffn_gate_inp + ffn_{gate,down,up}_exps).
Slots 0-3 are the blocks, slot 4 the output layer (output_norm + output). token_embd is the input layer and always
starts on the CPU.
"""
from __future__ import annotations

import shlex
from dataclasses import replace

import pytest

from planner.archs import ArchSpec, build_inventory
from planner.builds import Build
from planner.errors import FlagError
from planner.flags import (
    Override, assign, compile_pattern, effective_min_batch, home_devices, int_set_regex, knob_fields, parse, render,
    render_shell,
)
from planner.flags.common import alternation, translate_ecmascript
from planner.model import Hparams, ModelInventory
from planner.plan import Knobs, OffloadPolicy, OpRule, Plan


def tiny(arch: str = "qwen3moe", n: int = 4, lead: int = 1, nextn: int = 0, tied: bool = False) -> ModelInventory:
    shexp = arch in ("glm4moe", "deepseek2")
    hp = Hparams(arch=arch, n_layer=n, n_embd=64, n_vocab=256, n_head=4, n_head_kv=(2,) * n, head_dim_k=16,
                 head_dim_v=16, n_ctx_train=2048, n_ff=128, n_expert=8, n_expert_used=2, n_ff_exp=32,
                 n_expert_shared=1 if shexp else 0, n_ff_shexp=32 if shexp else 0,
                 moe_layers=tuple(i >= lead for i in range(n)), n_rot=16, n_nextn=nextn)
    return build_inventory(ArchSpec(hp, frozenset()), lambda name, shape, layer: "F32", tied_output=tied)


INV = tiny()
NAMES = [t.name for t in INV.allocated()]
EXPERTS = [t.name for t in INV.allocated() if t.is_expert]


def gpu_set(assignment: dict[str, str], device: str = "CUDA0") -> set[str]:
    return {n for n, d in assignment.items() if d == device}


def layer_names(*layers: int | str) -> set[str]:
    out = set()
    for t in INV.allocated():
        if t.layer in layers or ("out" in layers and t.layer is None and t.role in ("output", "output_norm")):
            out.add(t.name)
    return out


# ---- -ngl slots ---------------------------------------------------------------------------------------------

def test_mainline_ngl_1_is_the_output_layer_only():
    # mainline (PR #18148): -ngl N takes the LAST N of the 5 slots; slot 4 is the output layer
    a = parse("-ngl 1", INV, "mainline").assignment
    assert gpu_set(a) == {"output.weight", "output_norm.weight"}


def test_mainline_ngl_n_layer_is_output_plus_blocks_1_to_n_minus_1():
    a = parse("-ngl 4", INV, "mainline").assignment
    assert gpu_set(a) == layer_names(1, 2, 3, "out")
    assert a["blk.0.attn_q.weight"] == "CPU" and a["token_embd.weight"] == "CPU"


def test_ik_ngl_n_layer_is_every_block_and_no_output():
    # ik: the last N blocks; the output layer only when N > n_layer
    a = parse("-ngl 4", INV, "ik").assignment
    assert gpu_set(a) == layer_names(0, 1, 2, 3)
    assert a["output.weight"] == "CPU" and a["output_norm.weight"] == "CPU"


@pytest.mark.parametrize("dialect", ["mainline", "ik"])
def test_ngl_99_is_everything_but_token_embd(dialect):
    p = parse("-ngl 99", INV, dialect)
    assert gpu_set(p.assignment) == set(NAMES) - {"token_embd.weight"}
    assert p.layer_devices == ("CUDA0",) * 5
    assert not any(w.startswith("W006") for w in p.warnings)


def test_ngl_between_warns_that_dialects_differ():
    assert any(w.startswith("W006") for w in parse("-ngl 2", INV, "mainline").warnings)
    assert not any(w.startswith("W006") for w in parse("-ngl 0", INV, "mainline").warnings)


def test_mainline_ngl_all_and_negative_mean_everything():
    for v in ("all", "-1", "auto"):
        a = parse(["-ngl", v, "-fit", "off"], INV, "mainline").assignment
        assert gpu_set(a) == set(NAMES) - {"token_embd.weight"}


def test_ik_server_without_ngl_offloads_everything_since_pr_2209():
    # src/llama.cpp llama_model_load_from_file: n_gpu_layers < 0 (the default) -> 999 when a GPU exists
    p = parse("llama-server -c 512", INV, "ik")
    assert gpu_set(p.assignment) == set(NAMES) - {"token_embd.weight"}
    assert any(w.startswith("W017") for w in p.warnings)
    # builds before ik PR 2209 (4761) kept every layer on the CPU
    old = parse("llama-server -c 512", INV, "ik", build=Build("ik", 4760))
    assert set(old.assignment.values()) == {"CPU"}


def test_ik_ngl_0_drops_every_override_and_ncmoe():
    # src/llama.cpp ~7761: with -ngl 0 (or no GPU) tensor_buft_overrides and ncmoe are cleared
    p = parse(["-ngl", "0", "-ot", "blk\\.0\\.attn.*=CUDA0", "-ncmoe", "1"], INV, "ik")
    assert set(p.assignment.values()) == {"CPU"} and p.overrides == ()
    assert any(w.startswith("W027") for w in p.warnings)
    old = parse(["-ngl", "0", "-ot", "blk\\.0\\.attn_q.*=CUDA0"], INV, "ik", build=Build("ik", 4760))
    assert old.assignment["blk.0.attn_q.weight"] == "CUDA0"


def test_nextn_blocks_count_as_slots_but_are_not_assigned():
    # glm4moe with block_count 6 including one NextN block (blk.5): slots 0-5 blocks, slot 6 output.
    glm = tiny("glm4moe", 6, nextn=1)
    p = parse("-ngl 2", glm, "mainline")
    assert not any(n.startswith("blk.5.") for n in p.assignment)          # skipped by llama.cpp
    # the last 2 slots are the output layer and the (empty) NextN block: only the output moves
    assert gpu_set(p.assignment) == {"output.weight", "output_norm.weight"}
    assert p.layer_devices[5:] == ("CUDA0", "CUDA0")


def test_tied_output_has_only_output_norm_in_the_output_slot():
    inv = tiny(tied=True)
    a = parse("-ngl 1", inv, "mainline").assignment
    assert gpu_set(a) == {"output_norm.weight"}


# ---- -ot first match, -cmoe, -ncmoe -------------------------------------------------------------------------

def test_ot_first_match_wins_in_command_line_order():
    a = parse(["-ngl", "0", "-ot", r"blk\.1\.ffn_(up|down)_exps=CPU", "-ot", r"ffn_.*_exps=CUDA0"],
              INV, "mainline").assignment
    # blk.1 up/down match the first pattern (CPU); every other expert tensor the second (CUDA0)
    assert gpu_set(a) == set(EXPERTS) - {"blk.1.ffn_up_exps.weight", "blk.1.ffn_down_exps.weight"}


def test_ot_value_is_split_on_commas_into_separate_overrides():
    a = parse(["-ngl", "99", "-ot", r"blk\.1\.=CPU,exps=CPU"], INV, "mainline").assignment
    assert {n for n, d in a.items() if d == "CPU"} == layer_names(1) | set(EXPERTS) | {"token_embd.weight"}


def test_override_moves_a_tensor_of_a_cpu_layer_to_the_gpu():
    # ik -ngl 1: blk 3 on the GPU, blk 0 a CPU layer whose attn_q the -ot moves (with -ngl 0 ik would drop the
    # -ot since PR 2209: test_ik_ngl_0_drops_every_override_and_ncmoe; older builds kept it)
    a = parse(["-ngl", "1", "-ot", r"blk\.0\.attn_q\.weight=CUDA0"], INV, "ik").assignment
    assert gpu_set(a) == {"blk.0.attn_q.weight"} | layer_names(3)
    old = parse(["-ngl", "0", "-ot", r"blk\.0\.attn_q\.weight=CUDA0"], INV, "ik", build=Build("ik", 4000))
    assert gpu_set(old.assignment) == {"blk.0.attn_q.weight"}


def test_mainline_cmoe_after_ot_leaves_the_ot_in_charge():
    a = parse([*["-ngl", "99", "-ot"], r"blk\.3\.ffn_up_exps=CUDA0", "-cmoe"], INV, "mainline").assignment
    assert {n for n in EXPERTS if a[n] == "CPU"} == set(EXPERTS) - {"blk.3.ffn_up_exps.weight"}


def test_an_ot_pattern_shadowed_in_part_says_so_once():
    """Issue 40 item 11: a narrow -ot after a broader one that takes part of its tensors to another device: one W030
    naming how many and one of them; the idiom (the exception first, the catch-all after) and a pattern that loses
    all of its tensors (W002) get no W030."""
    p = parse(["-ngl", "99", "-ot", "exps=CPU", "-ot", r"blk\.3\.ffn_.*=CUDA0"], INV, "mainline")
    w030 = [w for w in p.warnings if w.startswith("W030")]
    assert len(w030) == 1 and "3 of the" in w030[0] and "to CUDA0" in w030[0]
    assert "e.g. blk.3.ffn_down_exps.weight" in w030[0]
    assert p.assignment["blk.3.ffn_up_exps.weight"] == "CPU"
    clean = parse(["-ngl", "99", "-ot", r"blk\.3\.ffn_.*=CUDA0", "-ot", "exps=CPU"], INV, "mainline")
    assert not [w for w in clean.warnings if w.startswith("W030")]
    whole = parse(["-ngl", "99", "-ot", "exps=CPU", "-ot", r"blk\.3\.ffn_up_exps=CUDA0"], INV, "mainline")
    assert [w[:4] for w in whole.warnings if w[:4] in ("W002", "W030")] == ["W002"]


def test_mainline_cmoe_before_ot_shadows_it():
    p = parse([*["-ngl", "99", "-cmoe", "-ot"], r"blk\.3\.ffn_up_exps=CUDA0"], INV, "mainline")
    assert all(p.assignment[n] == "CPU" for n in EXPERTS)
    assert any(w.startswith("W002") for w in p.warnings)
    assert [o.origin for o in p.overrides] == ["-cmoe", "-ot"]


def test_ik_applies_cmoe_after_every_ot_whatever_the_order():
    p = parse([*["-ngl", "99", "-cmoe", "-ot"], r"blk\.3\.ffn_up_exps=CUDA0"], INV, "ik")
    assert {n for n in EXPERTS if p.assignment[n] != "CPU"} == {"blk.3.ffn_up_exps.weight"}
    assert any(w.startswith("W019") for w in p.warnings)


def test_mainline_ncmoe_2_takes_layer_indices_0_and_1():
    # patterns blk\.0\.ffn_..._exps (dense block 0: matches nothing) and blk\.1\....: only block 1 moves
    p = parse("-ngl 99 -ncmoe 2", INV, "mainline")
    assert {n for n in EXPERTS if p.assignment[n] == "CPU"} == {n for n in EXPERTS if n.startswith("blk.1.")}
    assert [o.pattern for o in p.overrides] == [r"blk\.0\.ffn_(up|down|gate|gate_up)_(ch|)exps",
                                                r"blk\.1\.ffn_(up|down|gate|gate_up)_(ch|)exps"]
    assert not any(w.startswith("W001") for w in p.warnings)   # an empty dense-layer expansion is expected


def test_ik_server_ncmoe_2_takes_the_last_two_moe_layers():
    a = parse("llama-server -ngl 99 -ncmoe 2", INV, "ik").assignment
    assert {n for n in EXPERTS if a[n] == "CPU"} == {n for n in EXPERTS if n.startswith(("blk.2.", "blk.3."))}


def test_ik_bench_n_cpu_moe_2_takes_the_first_layer_indices():
    a = parse("llama-bench -ngl 99 --n-cpu-moe 2", INV, "ik").assignment
    assert {n for n in EXPERTS if a[n] == "CPU"} == {n for n in EXPERTS if n.startswith("blk.1.")}


def test_ncffn_moves_dense_ffn_of_the_first_layers():
    glm = tiny("glm4moe", 4)     # glm4moe block 0 is dense: ffn_gate/up/down; blocks 1-3 also have shared experts
    a = parse("-ngl 99 -ncffn 2", glm, "mainline").assignment
    # blk\.i\.ffn_(up|down|gate)\. for i = 0, 1: dense FFN of block 0; block 1 has none (shexp names differ)
    assert {n for n, d in a.items() if d == "CPU"} == {"token_embd.weight", "blk.0.ffn_gate.weight",
                                                        "blk.0.ffn_up.weight", "blk.0.ffn_down.weight"}


# ---- several GPUs ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dialect", ["mainline", "ik"])
def test_ts_1_1_splits_five_slots_three_and_two(dialect):
    # splits [0.5, 1.0]; slot i goes to upper_bound(splits, i/5): 0, .2, .4 -> CUDA0; .6, .8 -> CUDA1
    p = parse("-ngl 99 -ts 1,1", INV, dialect)
    assert p.layer_devices == ("CUDA0", "CUDA0", "CUDA0", "CUDA1", "CUDA1")
    assert gpu_set(p.assignment, "CUDA1") == layer_names(3, "out")


def test_ts_3_1_gives_the_second_gpu_only_the_last_slot():
    # mainline splits [0.75, 1.0]: 0, .2, .4, .6 < .75 -> CUDA0; .8 -> CUDA1 (the output layer)
    # (ik splits layer bytes instead: tests/planner/test_flags_ik.py)
    p = parse("-ngl 99 -ts 3,1", INV, "mainline")
    assert p.layer_devices == ("CUDA0",) * 4 + ("CUDA1",)
    assert p.n_gpus == 2


def test_ts_with_partial_ngl_splits_the_gpu_slots_only():
    # mainline -ngl 4: slots 1-4 on GPUs, act = 4: 0/4, 1/4 < .5 -> CUDA0; 2/4, 3/4 -> CUDA1
    p = parse("-ngl 4 -ts 1/1", INV, "mainline")
    assert p.layer_devices == ("CPU", "CUDA0", "CUDA0", "CUDA1", "CUDA1")


def test_assign_matches_parse():
    a = assign(INV, 99, [Override("exps", "CPU")], "mainline", n_gpus=2, tensor_split=[3, 1])
    assert a == parse(["-ngl", "99", "-ts", "3,1", "-ot", "exps=CPU"], INV, "mainline").assignment
    assert assign(INV, 99, [("exps", "CPU")], "ik") == parse("-ngl 99 -ot exps=CPU", INV, "ik").assignment


def test_split_mode_none_and_device_list_pick_one_gpu():
    assert set(parse("-ngl 99 -sm none -mg 1 -ts 1,1", INV, "mainline").layer_devices) == {"CUDA1"}
    assert set(parse("-ngl 99 -dev CUDA1", INV, "mainline", n_gpus=2).layer_devices) == {"CUDA1"}


def test_split_modes_beyond_layer_say_what_the_pinned_builds_do():
    """-sm row: the pinned mainline's CUDA backend refuses to load (measured); -sm tensor: tensor parallelism; both
    explained as the layer split; ik's -sm graph too (docs/ik_llama.md: tensor parallel, -ncmoe from the last)."""
    def w013(cmd, dialect):
        return next(w for w in parse(cmd, INV, dialect).warnings if w.startswith("W013"))
    assert "does not support split buffers" in w013("-ngl 99 -sm row -ts 1,1", "mainline")
    assert "tensor parallelism" in w013("-ngl 99 -sm tensor -ts 1,1", "mainline")
    graph = w013("-ngl 99 -sm graph -ts 1,1", "ik")
    assert "tensor parallelism" in graph and "last N layers" in graph and graph.endswith("(-sm layer)")
    assert w013("-ngl 99 -sm attn -ts 1,1", "ik") == "W013 -sm attn: placement is explained as the layer split " \
        "(-sm layer)"
    assert not any(w.startswith("W013") for w in parse("-ngl 99 -sm layer -ts 1,1", INV, "mainline").warnings)


def test_several_gpus_without_ts_warn_and_split_equally():
    p = parse("-ngl 99 -ot blk\\.0\\.attn_q=CUDA1", INV, "mainline")
    assert p.n_gpus == 2 and any(w.startswith("W012") for w in p.warnings)


# ---- errors ---------------------------------------------------------------------------------------------------

def test_comma_inside_a_pattern_is_an_error_that_says_so():
    with pytest.raises(FlagError, match="comma"):
        parse(["-ngl", "99", "-ot", r"blk\.{1,3}\.ffn_up_exps=CPU"], INV, "mainline")
    with pytest.raises(FlagError, match="comma"):
        parse(["-ngl", "99", "-ot", r"blk\.(1,2)\.ffn_up_exps=CPU"], INV, "ik")


@pytest.mark.parametrize("buft", ["GPU0", "cuda0", "CUDA"])
def test_unknown_buffer_type_lists_the_valid_ones(buft):
    with pytest.raises(FlagError, match="valid names: CPU, CUDA0") as e:
        parse(["-ot", f"exps={buft}"], INV, "mainline", n_gpus=1)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("buft", ["CUDA_Host", "CPU_REPACK"])
def test_host_and_repack_buffer_types_are_rejected(buft):
    with pytest.raises(FlagError, match=f"{buft}.*rejects"):
        parse(["-ngl", "99", "-ot", f"exps={buft}"], INV, "ik")


def test_cuda_index_beyond_the_gpus_is_rejected_when_the_count_is_known():
    with pytest.raises(FlagError, match="CUDA2"):
        parse(["-ot", "exps=CUDA2"], INV, "mainline", n_gpus=2)


def test_unknown_flag_is_rejected_by_mainline_known_irrelevant_ones_are_ignored():
    with pytest.raises(FlagError, match="--frobnicate"):
        parse("llama-server --frobnicate -ngl 99", INV, "mainline")
    p = parse("llama-server -m m.gguf --host 0.0.0.0 --port 8080 --jinja -ngl 99 --temp 0.6 -fit off", INV,
              "mainline")
    assert gpu_set(p.assignment) == set(NAMES) - {"token_embd.weight"}
    with pytest.raises(FlagError):
        parse("llama-bench --port 8080", INV, "mainline")    # not a llama-bench flag


def test_ik_unknown_flag_is_a_warning():
    p = parse("llama-server -ngl 99 --brand-new-flag 3", INV, "ik")
    assert any(w.startswith("W024") for w in p.warnings)


@pytest.mark.parametrize("pattern", [r"exps++", r"(?P<x>exps)", r"(?<!x)up", r"(?i)EXPS", r"exps\Z", r"[]a]",
                                     r"(?>exps)", "{2}x"])
def test_regex_constructs_std_regex_reads_differently_are_rejected(pattern):
    with pytest.raises(FlagError, match="ECMAScript|regex"):
        parse(["-ot", f"{pattern}=CPU"], INV, "mainline")


def test_posix_classes_and_lookahead_work_as_in_std_regex():
    a = parse(["-ngl", "99", "-ot", r"blk\.[[:digit:]]\.ffn_(?!down)[a-z]+_exps=CPU"], INV, "mainline").assignment
    assert {n for n in EXPERTS if a[n] == "CPU"} == {n for n in EXPERTS if "down" not in n}


def test_bench_tool_specific_values():
    # llama-bench: -nkvo and -nopo take 0|1, and no llama-server flag is accepted
    with pytest.raises(FlagError):
        parse("llama-bench -nkvo", INV, "mainline")
    with pytest.raises(FlagError, match="unknown value"):
        parse("llama-bench -nkvo yes", INV, "mainline")


# ---- warnings -----------------------------------------------------------------------------------------------

def codes(p) -> set[str]:
    return {w.split()[0] for w in p.warnings}


def test_warnings_have_stable_codes():
    p = parse(["llama-server", "-ngl", "2", "-nkvo", "-b", "512", "-ub", "1024", "-ot", "nothing_here=CPU",
               "-ot", "exps=CPU", "-ot", r"blk\.1\.ffn_up_exps=CUDA0", "-ot", "token_embd=CUDA0"], INV, "mainline")
    assert {"W001", "W002", "W004", "W005", "W006", "W007", "W009", "W014", "W020"} <= codes(p)
    assert p.knobs.n_ubatch_eff == 512 and p.knobs.no_kv_offload


def test_bench_comma_in_ot_is_a_sweep_and_semicolons_join_one_set():
    p = parse(["llama-bench", "-ngl", "99", "-ot", "exps=CPU;attn_q=CPU"], INV, "mainline")
    assert len(p.overrides) == 2 and "W003" not in codes(p)
    p = parse(["llama-bench", "-ngl", "99", "-ot", "exps=CPU,attn_q=CPU"], INV, "mainline")
    assert [o.pattern for o in p.overrides] == ["exps"] and "W003" in codes(p)
    p = parse("llama-bench -ngl 99 -ub 256-1024*2 -ts 1/1,3/1", INV, "mainline")
    assert p.knobs.n_ubatch == 256 and p.tensor_split == (1.0, 1.0) and "W011" in codes(p)


def test_flag_equals_value_env_prefix_and_binary_are_accepted():
    p = parse("GGML_OP_OFFLOAD_MIN_BATCH=64 CUDA_VISIBLE_DEVICES=0,1 ./build/bin/llama-server --n-gpu-layers=99 "
              "--ctx-size 8192 -np 1 -fit off", INV, "mainline")
    assert p.knobs.offload == OffloadPolicy.all(True, 64)
    assert p.knobs.n_ctx == 8192 and p.n_gpus == 2 and "W008" in codes(p)
    assert parse("LLAMA_ARG_N_GPU_LAYERS=1 llama-server -fit off", INV, "mainline").n_gpu_layers == 1


def test_mainline_knobs_from_flags():
    # (a quantized K without flash attention is fine; a quantized V is refused: test_reliability)
    k = parse("-ngl 99 -c 8192 -np 1 -b 4096 -ub 4096 -fa off -ctk q8_0 -ctv bf16 -t 16 -lm none --swa-full "
              "--no-op-offload -fit off", INV, "mainline").knobs
    assert (k.n_ctx, k.n_seq, k.n_batch, k.n_ubatch, k.flash_attn, k.type_k, k.type_v, k.n_threads, k.mmap,
            k.swa_full, k.offload.any_enabled) == (8192, 1, 4096, 4096, False, "q8_0", "bf16", 16, False, True, False)


def test_ik_knobs_from_flags():
    k = parse("llama-server -ngl 99 -c 8192 -np 1 -fa on -mla 2 -amb 512 -no-fmoe -rtr -no-ooae -op 28,0,31,0 "
              "-cuda offload-batch-size=64", INV, "ik").knobs
    assert (k.mla, k.amb, k.fmoe, k.rtr, k.mmap, k.only_active_experts) == (2, 512, False, True, False, False)
    assert k.offload == OffloadPolicy(dense_matmul=OpRule(True, 64), moe_matmul=OpRule(False, 64),
                                      moe_fused_up_gate=OpRule(False, 64), output=OpRule(True, 64))
    k = parse("-op -1,0,27,1", INV, "ik").knobs      # -1: every op; then MUL_MAT back on
    assert k.offload.dense_matmul.enabled and not k.offload.moe_matmul.enabled
    k = parse("-op 26,0", INV, "ik", ik_op_table="2025-05").knobs
    assert not k.offload.dense_matmul.enabled and k.offload.moe_matmul.enabled


# ---- rendering ------------------------------------------------------------------------------------------------

def plan_experts_on_cpu(layers: tuple[int, ...], dialect: str, knobs: Knobs = Knobs()) -> Plan:
    a = {n: ("CPU" if n == "token_embd.weight" else "CUDA0") for n in NAMES}
    for t in INV.allocated():
        if t.is_expert and t.layer in layers:
            a[t.name] = "CPU"
    return Plan("tiny", a, knobs, dialect)  # type: ignore[arg-type]


def test_render_uses_ncmoe_when_it_is_exact_and_shorter():
    assert render(plan_experts_on_cpu((1, 2), "mainline"), INV) == [
        "-ngl", "5", "-ncmoe", "3", "-fit", "off", "-c", "8192", "-np", "1", "-b", "2048", "-ub", "512", "-fa", "on"]
    assert list(render(plan_experts_on_cpu((1, 2, 3), "mainline"), INV))[:3] == ["-ngl", "5", "-cmoe"]
    # ik's server -ncmoe takes the last MoE layers: layers 1-2 need an explicit, compact -ot
    assert list(render(plan_experts_on_cpu((1, 2), "ik"), INV))[:4] == [
        "-ngl", "5", "-ot", r"blk\.[12]\.ffn_(down|gate|up)_exps=CPU"]
    assert list(render(plan_experts_on_cpu((2, 3), "ik"), INV))[:4] == ["-ngl", "5", "-ncmoe", "2"]


def test_render_bench_uses_the_workload_and_bench_spellings():
    class WL:
        n_prompt, n_gen, depth, repetitions = 4096, 64, 8192, 3
    k = Knobs(n_ubatch=4096, n_batch=4096, no_kv_offload=True, offload=OffloadPolicy.all(False))
    rc = render(plan_experts_on_cpu((), "mainline", k), INV, "bench", bench=WL())
    assert list(rc) == ["-p", "4096", "-n", "64", "-d", "8192", "-r", "3", "-ngl", "5", "-b", "4096", "-ub", "4096",
                        "-fa", "1", "-nkvo", "1", "-nopo", "1"]
    with pytest.raises(FlagError, match="-d"):
        render(plan_experts_on_cpu((), "ik"), INV, "bench", bench=WL())


def test_render_op_offload_per_dialect():
    k = Knobs(offload=OffloadPolicy.all(True, 64))
    rc = render(plan_experts_on_cpu((), "mainline", k), INV)
    assert rc.env == {"GGML_OP_OFFLOAD_MIN_BATCH": "64"}
    line = render_shell(plan_experts_on_cpu((), "mainline", k), INV)
    assert line.startswith("GGML_OP_OFFLOAD_MIN_BATCH=64 llama-server ")
    mixed = Knobs(offload=OffloadPolicy(moe_matmul=OpRule(False)))
    with pytest.raises(FlagError, match="offload"):
        render(plan_experts_on_cpu((), "mainline", mixed), INV)
    with pytest.raises(FlagError, match="only_active_experts"):
        render(plan_experts_on_cpu((), "mainline", Knobs(only_active_experts=False)), INV)
    rc = render(plan_experts_on_cpu((), "ik", mixed), INV)
    assert rc.argv[rc.argv.index("-op") + 1] == "28,0"
    rc = render(plan_experts_on_cpu((), "ik", mixed), INV, ik_op_table="2025-05")
    assert rc.argv[rc.argv.index("-op") + 1] == "27,0"
    rc = render(plan_experts_on_cpu((), "ik", Knobs(offload=OffloadPolicy.all(True, 64), only_active_experts=False)),
                INV)
    assert "-no-ooae" in rc.argv and rc.argv[rc.argv.index("-cuda") + 1] == "offload-batch-size=64"
    with pytest.raises(FlagError, match="-op"):
        render(plan_experts_on_cpu((), "ik", mixed), INV, "bench")
    with pytest.raises(FlagError, match="output"):
        render(plan_experts_on_cpu((), "ik", Knobs(offload=OffloadPolicy(output=OpRule(False)))), INV)


def test_render_rejects_knobs_the_dialect_lacks():
    with pytest.raises(FlagError, match="mla"):
        render(plan_experts_on_cpu((), "mainline", Knobs(mla=1)), INV)
    with pytest.raises(FlagError, match="swa_full"):
        render(plan_experts_on_cpu((), "ik", Knobs(swa_full=True)), INV)
    with pytest.raises(FlagError, match="f32"):
        render(plan_experts_on_cpu((), "mainline", Knobs(type_k="f32")), INV, "bench")


def test_render_multi_gpu_emits_layer_counts_as_ts():
    p = parse("-ngl 99 -ts 3,2 -ot exps=CPU", INV, "mainline").to_plan("tiny")
    rc = render(p, INV)
    assert rc.argv[rc.argv.index("-ts") + 1] == "3,2"
    assert parse(rc, INV, "mainline").layer_devices == ("CUDA0",) * 3 + ("CUDA1",) * 2
    rc = render(p, INV, "bench")
    assert rc.argv[rc.argv.index("-ts") + 1] == "3/2"


def test_render_keeps_layer_homes_so_kv_follows():
    p = plan_experts_on_cpu((1,), "ik")
    assert tuple(home_devices(p.assignment, INV)) == parse(render(p, INV), INV, "ik").layer_devices


def test_render_shell_round_trips_through_shlex():
    p = parse(["-ngl", "3", "-ot", r"blk\.(1|2)\.ffn_up_exps=CPU,^output\.weight=CPU"], INV, "mainline").to_plan()
    line = render_shell(p, INV)
    argv = shlex.split(line)
    assert argv[0] == "llama-server"
    assert parse(argv, INV, "mainline").assignment == p.assignment
    assert parse(line, INV, "mainline").assignment == p.assignment


def test_render_rejects_a_plan_that_does_not_cover_the_model():
    a = {n: "CPU" for n in NAMES[1:]}
    with pytest.raises(FlagError, match="unassigned"):
        render(Plan("tiny", a), INV)
    with pytest.raises(FlagError, match="device"):
        render(Plan("tiny", {**{n: "CPU" for n in NAMES}, "output.weight": "GPU"}), INV)


def test_knob_fields_and_effective_min_batch():
    assert "n_ctx" in knob_fields("mainline", "server") and "n_ctx" not in knob_fields("mainline", "bench")
    assert "mla" in knob_fields("ik", "server") and "mla" not in knob_fields("mainline", "server")
    k = Knobs()
    assert effective_min_batch(k, "moe_matmul", "ik", INV) == 32 * 8 // 2
    assert effective_min_batch(k, "moe_matmul", "mainline", INV) == 32
    assert effective_min_batch(k, "dense_matmul", "ik", INV) == 32


# ---- regex compaction -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("values, expected", [
    (range(3, 41), "[3-9]|[1-3][0-9]|40"), (range(10, 24), "1[0-9]|2[0-3]"), ([0, 2, 4], "[024]"),
    ([7], "7"), ([1, 2], "[12]"), (range(0, 100), "[0-9]|[1-9][0-9]"), ([9, 10], "9|10"),
    ([10, 19, 30, 39], "1[09]|3[09]"),
])
def test_int_set_regex(values, expected):
    assert int_set_regex(values) == expected


def test_alternation_factors_common_parts():
    assert alternation(["ffn_up_exps", "ffn_gate_exps", "ffn_down_exps"]) == "ffn_(down|gate|up)_exps"
    assert alternation(["output.weight", "output_norm.weight"]) == r"output(|_norm)\.weight"


def test_translate_keeps_plain_patterns():
    assert translate_ecmascript(r"blk\.(1|2)\.ffn_.*_exps") == r"blk\.(1|2)\.ffn_.*_exps"
    assert compile_pattern(r"blk\.1[0-9]\.x").literal == "blk.1"


# ---- more of what llama.cpp does ------------------------------------------------------------------------------

def test_tied_output_copy_follows_token_embd_override_else_the_output_slot():
    inv = tiny(tied=True)
    assert parse("-ngl 99", inv, "mainline").output_copy_device == "CUDA0"
    # the duplicate is looked up as "token_embd.weight": an override of token_embd moves both copies
    assert parse("-ngl 99 -ot token_embd=CPU", inv, "mainline").output_copy_device == "CPU"
    assert parse("-ngl 99", INV, "mainline").output_copy_device is None


def test_environment_overrides_come_before_the_command_line():
    p = parse(["LLAMA_ARG_OVERRIDE_TENSOR=exps=CPU", "llama-server", "-ngl", "99", "-ot", "exps=CUDA0"],
              INV, "mainline")
    assert [(o.origin, o.device) for o in p.overrides] == [("LLAMA_ARG_OVERRIDE_TENSOR", "CPU"), ("-ot", "CUDA0")]
    assert all(p.assignment[n] == "CPU" for n in EXPERTS)
    assert parse("LLAMA_ARG_NO_KV_OFFLOAD=1 llama-server -ngl 99", INV, "mainline").knobs.no_kv_offload
    assert not parse("LLAMA_ARG_NO_KV_OFFLOAD=1 llama-server -kvo", INV, "mainline").knobs.no_kv_offload


def test_repeated_scalar_flag_uses_the_last_value_and_warns():
    p = parse("-ngl 1 -ngl 99 --flash_attn off", INV, "mainline")
    assert p.n_gpu_layers == 99 and "W010" in codes(p) and p.knobs.flash_attn is False


def test_ik_moe_threshold_note():
    # 8 experts, 2 used: ik offloads MUL_MAT_ID only from ubatch 32 * 8 / 2 = 128
    p = parse("-ngl 99 -cmoe -ub 64 -b 64", INV, "ik")
    assert "W026" in codes(p)
    assert "W026" not in codes(parse("-ngl 99 -cmoe -ub 128", INV, "ik"))
    rc = render(plan_experts_on_cpu((1, 2, 3), "ik", Knobs(n_ubatch=64)), INV)
    assert any(n.startswith("W026") for n in rc.notes)


def test_render_ik_extras_and_no_mmap_spellings():
    k = Knobs(mla=2, amb=512, fmoe=False, rtr=True, mmap=False)
    argv = list(render(plan_experts_on_cpu((), "ik", k), INV))
    # INV has no MLA: -mla is moot, and so is -amb with flash attention (test_flags_ik: an MLA model keeps both)
    assert "-mla" not in argv and "-amb" not in argv
    no_fa = list(render(plan_experts_on_cpu((), "ik", replace(k, flash_attn=False)), INV))
    assert no_fa[no_fa.index("-amb") + 1] == "512"
    assert "-no-fmoe" in argv and "-rtr" in argv
    bench = list(render(plan_experts_on_cpu((), "ik", k), INV, "bench"))
    assert bench[bench.index("-fmoe") + 1] == "0" and bench[bench.index("-rtr") + 1] == "1"
    assert bench[bench.index("-mmp") + 1] == "0"
    main = list(render(plan_experts_on_cpu((), "mainline", Knobs(mmap=False)), INV))
    assert main[main.index("-lm") + 1] == "none"           # this mainline has no --no-mmap
    with pytest.raises(FlagError, match="mmap"):
        render(plan_experts_on_cpu((), "ik", Knobs(rtr=True)), INV)


def test_no_host_is_mainline_only_written_when_set_and_read_back():
    k = Knobs(no_host=True)
    for tool, tail in (("server", ["--no-host"]), ("cli", ["--no-host"]), ("bench", ["--no-host", "1"])):
        rc = render(plan_experts_on_cpu((1, 2, 3), "mainline", k), INV, tool)
        assert list(rc)[-len(tail):] == tail, (tool, list(rc))
        assert parse(rc, INV, "mainline", tool=tool).knobs.no_host is True
        plain = render(plan_experts_on_cpu((1, 2, 3), "mainline"), INV, tool)
        assert "--no-host" not in plain and parse(plain, INV, "mainline", tool=tool).knobs.no_host is False
    assert parse("llama-bench -ngl 99 --no-host 0", INV, "mainline").knobs.no_host is False
    assert parse("LLAMA_ARG_NO_HOST=1 llama-server -ngl 99", INV, "mainline").knobs.no_host is True
    with pytest.raises(FlagError, match="unknown value"):
        parse("llama-bench --no-host yes", INV, "mainline")
    for tool in ("server", "bench"):
        with pytest.raises(FlagError, match=r"no_host=True is mainline's --no-host; ik .* has no such flag"):
            render(plan_experts_on_cpu((), "ik", k), INV, tool)
    ik = parse("llama-server -ngl 99 --no-host", INV, "ik")           # ik's table is not strict: a warning
    assert ik.knobs.no_host is False and "W024" in codes(ik)
    # a plan without the knob keeps the id it had before the knob existed (the JSON leaves the default out)
    p = plan_experts_on_cpu((1,), "mainline")
    assert "no_host" not in p.to_json() and Plan.from_json(p.to_json()) == p
    q = plan_experts_on_cpu((1,), "mainline", k)
    assert Plan.from_json(q.to_json()) == q and q.id != p.id


def test_parse_accepts_a_rendered_command_and_multiline_paste():
    p = plan_experts_on_cpu((2, 3), "mainline")
    rc = render(p, INV)
    assert parse(rc, INV, "mainline").assignment == p.assignment
    pasted = "llama-server \\\n  " + " \\\n  ".join(shlex.quote(a) for a in rc)
    assert parse(pasted, INV, "mainline").assignment == p.assignment


def test_rendered_command_is_the_argv_list():
    rc = render(plan_experts_on_cpu((), "mainline", Knobs(offload=OffloadPolicy.all(True, 64))), INV)
    assert isinstance(rc, list) and all(isinstance(a, str) for a in rc)
    assert rc.argv == tuple(rc) and rc.env == {"GGML_OP_OFFLOAD_MIN_BATCH": "64"} and rc.tool == "server"
    assert rc.shell("").startswith("GGML_OP_OFFLOAD_MIN_BATCH=64 -ngl")
