"""Memory model on tiny inventories whose bytes are added up by hand (tiny.py), plus preset facts."""
from __future__ import annotations

from dataclasses import replace

import pytest

from planner.hardware import MiB, load_hardware
from planner.ik_pool import MoeShape, _ik_fattn_pool, _ik_moe_op_pool, ik_fattn_pool_bytes, pool_bytes
from planner.memory import (compute_bytes, estimate, ik_mla_plan, ik_wkv_b_bytes, kv_bytes, kv_layer_bytes,
                            weight_bytes)
from planner.residency import kv_cells
from planner.plan import Knobs, OffloadPolicy, OpRule, Plan
from planner.presets import load_preset, preset_names

from tiny import (LAYER_DENSE, LAYER_EXPERTS, OUTPUT, OUTPUT_NORM, TOKEN_EMBD, deepseek2_spec, f32_inventory,
                  qwen3moe_spec)


def _plan(inv, where, knobs=Knobs(n_ctx=512), dialect="mainline"):
    return Plan("tiny", {t.name: where(t) for t in inv.allocated()}, knobs, dialect)


def test_all_on_cpu_weights_are_the_sum_of_tensors():
    inv = f32_inventory(qwen3moe_spec())
    w = weight_bytes(inv, _plan(inv, lambda t: "CPU"))
    assert w == {"CPU": 2 * (LAYER_DENSE + LAYER_EXPERTS) + TOKEN_EMBD + OUTPUT_NORM + OUTPUT}


def test_experts_on_cpu_rest_on_gpu():
    # -ngl 99 -cmoe: every layer and the output on CUDA0, expert tensors and token_embd on the CPU
    inv = f32_inventory(qwen3moe_spec())
    plan = _plan(inv, lambda t: "CPU" if t.is_expert or t.role == "token_embd" else "CUDA0")
    assert weight_bytes(inv, plan) == {"CUDA0": 2 * LAYER_DENSE + OUTPUT_NORM + OUTPUT,
                                       "CPU": 2 * LAYER_EXPERTS + TOKEN_EMBD}
    # KV follows the layer's home (attn_norm on CUDA0): f16, 512 cells, K and V rows of 2 heads x 16 x 2 B
    assert kv_bytes(inv, plan) == {"CUDA0": 2 * 512 * (64 + 64)}


def test_tied_output_loads_token_embd_again_on_the_output_device():
    inv = f32_inventory(qwen3moe_spec(), tied_output=True)
    assert inv.tied_output
    plan = _plan(inv, lambda t: "CUDA0" if t.role == "output_norm" else "CPU")
    w = weight_bytes(inv, plan)
    assert w["CUDA0"] == OUTPUT_NORM + TOKEN_EMBD
    # on the CPU the duplicate is the same mapped data: no second copy
    assert weight_bytes(inv, _plan(inv, lambda t: "CPU")) == \
        {"CPU": 2 * (LAYER_DENSE + LAYER_EXPERTS) + TOKEN_EMBD + OUTPUT_NORM}


def test_nkvo_puts_all_kv_on_the_host():
    inv = f32_inventory(qwen3moe_spec())
    plan = _plan(inv, lambda t: "CUDA0", Knobs(n_ctx=512, no_kv_offload=True))
    assert set(kv_bytes(inv, plan)) == {"CPU"}


def test_kv_cells_pad_to_256_and_swa_layers_are_smaller_in_mainline_only():
    spec = qwen3moe_spec(n_layer=2, swa_layers=(True, False), n_swa=128)
    inv = f32_inventory(spec)
    k = Knobs(n_ctx=4000, n_ubatch=512)
    assert k.kv_size == 4096
    assert kv_cells(inv, k, 1, "mainline") == 4096
    assert kv_cells(inv, k, 0, "mainline") == 768        # pad256(min(4096, 128 * 1 + 512))
    assert kv_cells(inv, k, 0, "ik") == 4096             # ik: full n_ctx on every layer
    assert kv_cells(inv, replace(k, swa_full=True), 0, "mainline") == 4096


def test_quantized_kv_row_sizes():
    inv = f32_inventory(qwen3moe_spec())
    # one layer, 256 cells, K and V rows of 32 elements: q8_0 = 34 B per 32, q4_0 = 18 B per 32
    assert kv_layer_bytes(inv, Knobs(n_ctx=256, type_k="q8_0", type_v="q8_0"), 0, "mainline") == 256 * 2 * 34
    assert kv_layer_bytes(inv, Knobs(n_ctx=256, type_k="q8_0", type_v="q4_0"), 0, "mainline") == 256 * (34 + 18)


def test_deepseek_v3_mla_cache_is_70272_bytes_per_token():
    # docs/llamacpp.md section 5: 61 layers x (512 + 64) x 2 bytes
    inv = load_preset("DeepSeek-V3").inventory()
    plan = Plan("ds", {t.name: "CPU" for t in inv.allocated()}, Knobs(n_ctx=1024))
    assert kv_bytes(inv, plan)["CPU"] == 70272 * 1024


def test_effective_ubatch_is_clamped_by_batch_and_context():
    assert Knobs(n_ctx=20, n_batch=2048, n_ubatch=512).n_ubatch_eff == 20
    assert Knobs(n_ctx=8192, n_batch=1024, n_ubatch=4096).n_ubatch_eff == 1024


def test_nextn_layers_are_not_allocated():
    inv = load_preset("GLM-4.5-Air").inventory()
    assert inv.hparams.n_layer == 47 and inv.hparams.n_nextn == 1
    nextn = [t for t in inv.tensors if t.layer == 46]
    assert nextn and all(t.role == "nextn" for t in nextn)
    plan = Plan("glm", {t.name: "CPU" for t in inv.allocated()}, Knobs(n_ctx=256))
    assert weight_bytes(inv, plan)["CPU"] == inv.total_bytes() == sum(t.nbytes for t in inv.tensors if t.layer != 46)
    assert kv_layer_bytes(inv, plan.knobs, 46, "mainline") == 0


def test_op_offload_adds_upload_targets_to_the_gpu_compute_buffer():
    # Experts large enough to matter (n_ff_exp 256: each expert tensor 64 x 256 x 4 experts x 4 B = 256 KiB).
    # With op offload the MoE matmuls of a ubatch run on CUDA0: each expert tensor is copied into CUDA0's compute
    # buffer at the start of its own split (ggml-backend.cpp pass 5 starts a split per weight from another
    # device), so the buffer grows by at least the largest one, not by the layer's sum; the CPU's shrinks.
    inv = f32_inventory(qwen3moe_spec(n_ff_exp=256))
    largest = max(t.nbytes for t in inv.tensors if t.is_expert)
    def where(t):
        return "CPU" if t.is_expert or t.role == "token_embd" else "CUDA0"
    on = _plan(inv, where, Knobs(n_ctx=512, n_ubatch=512))
    off = replace(on, knobs=replace(on.knobs, offload=OffloadPolicy.all(False)))
    gpu_on, gpu_off = estimate(inv, on).devices["CUDA0"], estimate(inv, off).devices["CUDA0"]
    assert gpu_on.compute >= gpu_off.compute + largest
    assert estimate(inv, off).devices["CPU"].compute > estimate(inv, on).devices["CPU"].compute


@pytest.mark.parametrize("dialect", ["mainline", "ik"])
@pytest.mark.parametrize("name", preset_names())
def test_reduced_graph_gives_the_full_graph_peaks(name, dialect):
    # compute_bytes builds only a few layers of each run of identical layers; the peaks must not change
    inv = load_preset(name).inventory()
    n = inv.n_layer - inv.hparams.n_nextn
    plans = [
        _plan(inv, lambda t: "CPU", Knobs(n_ctx=8192, n_ubatch=512), dialect),
        _plan(inv, lambda t: "CPU" if t.is_expert or t.role == "token_embd" else "CUDA0",
              Knobs(n_ctx=4096, n_ubatch=2048, n_batch=2048, flash_attn=False), dialect),
        _plan(inv, lambda t: "CUDA0" if t.layer is None and t.role != "token_embd"
              or (t.layer is not None and t.layer >= n - 6) else "CPU", Knobs(n_ctx=8192, n_ubatch=1024), dialect),
    ]
    for plan in plans:
        assert compute_bytes(inv, plan) == compute_bytes(inv, plan, reduce=False)


def test_mmap_vs_pinned_host_weights():
    inv = f32_inventory(qwen3moe_spec())
    def where(t):
        return "CPU" if t.is_expert or t.role == "token_embd" else "CUDA0"
    mm = estimate(inv, _plan(inv, where))
    assert mm.host_mapped == 2 * LAYER_EXPERTS + TOKEN_EMBD and mm.host_pinned == 0
    pinned = estimate(inv, _plan(inv, where, Knobs(n_ctx=512, mmap=False)))
    assert pinned.host_pinned == 2 * LAYER_EXPERTS + TOKEN_EMBD and pinned.host_mapped == 0
    # ik maps overridden CPU weights from the file too (its host buffer type qualifies for the mmap buffer,
    # ik 8337e4cd src/llama.cpp ~4735; docs/ik_llama.md); only --no-mmap / -rtr copy them
    ik = estimate(inv, _plan(inv, where, dialect="ik"))
    assert ik.host_mapped == 2 * LAYER_EXPERTS + TOKEN_EMBD and ik.host_pinned == 0


def test_ik_flash_attention_pool_on_the_qwen3_30b_shape():
    # ik 8337e4cd ggml-cuda/fattn-mma-f16.cuh launch_fattn_mma, 32 heads of 128, 4 KV heads (GQA 8: ncols2 8,
    # ncols1 8, 64 columns a tile), an H100's 132 SMs. 2048 tokens: 256 x 4 = 1024 tiles fill 4 waves of 264
    # blocks 96 % (>= 75): one block per tile, dst_tmp_meta = 1024 * 64 * (4 + 128) * 4 float2 = 264 MiB, plus
    # KV_min_max (256 int2) from 1024 tokens; the pool maps 2 MiB steps
    assert _ik_fattn_pool(2048, 128, 32, 4, 2048, 0, False, False, 132) == 1024 * 64 * 132 * 4 * 8 + 2048
    assert ik_fattn_pool_bytes(2048, 128, 32, 4, 2048, n_sm=132) == 266 * MiB
    assert _ik_fattn_pool(512, 128, 32, 4, 512, 0, False, False, 132) == 66 * MiB      # 256 tiles, 1 wave
    # a server also runs smaller batches: a poorly filled wave takes the stream-k path, 2 blocks per SM
    assert _ik_fattn_pool(100, 128, 32, 4, 512, 0, False, False, 132) == 264 * 64 * 132 * 4 * 8
    assert ik_fattn_pool_bytes(512, 128, 32, 4, 512, n_sm=132) == 70 * MiB
    # past 2048 tokens stream-k again: -ub 4096 holds 68 MiB at 4096 tokens, 266 MiB once a 2048-token batch ran
    assert _ik_fattn_pool(4096, 128, 32, 4, 4096, 0, False, False, 132) < 69 * MiB
    assert ik_fattn_pool_bytes(4096, 128, 32, 4, 4096, n_sm=132) == 266 * MiB
    # a quantized cache is converted to F16 in the pool: K and V of 8704 cells x 4 heads x 128, 8.5 MiB each,
    # beside the 68.06 MiB of stream-k: 85.06 MiB -> 86
    assert ik_fattn_pool_bytes(512, 128, 32, 4, 8704, 0, True, True, 132) == 86 * MiB


def test_ik_moe_pool_on_the_qwen3_30b_shape():
    # ik 8337e4cd ggml-cuda.cu:3210-3305, mmq_id.cu:317-497: the fused up/gate of 4096 tokens x 8 experts =
    # 32768 rows holds its row ids ((2 x 32768 + 129) int32 = 262660 bytes, 262784 in the pool's 128-byte steps),
    # q8_1 of the rows (2048 values: 64 blocks of 36 bytes, plus 128 MMQ blocks of 144), F32 up and gate results
    # (768 each) and the stream-k fixup (132 SMs x 128 x 128 floats: 32 x 6 x 128 tiles do not divide among 132)
    m = MoeShape(n_embd=2048, n_ff=768, n_expert=128, n_expert_used=8, merged=False, mmq_up=True, mmq_down=True)
    R = 4096 * 8
    fused = 262784 + R * 64 * 36 + 128 * 144 + 2 * R * 768 * 4 + 132 * 128 * 128 * 4
    assert _ik_moe_op_pool("fused", 4096, m, 132) == fused                     # 272.5 MiB
    assert _ik_moe_op_pool("fused", 2048, m, 132) < 141 * MiB                  # below flash attention's 266
    # without -fmoe: MUL_MAT_ID of up (or gate) alone, ids (3 requests: 516 bytes of expert bounds take 640) and
    # q8_1 of the rows; down's rows are 768 wide, padded to 1024
    assert _ik_moe_op_pool("up", 4096, m, 132) == 2 * R * 4 + 640 + R * 64 * 36 + 128 * 144 \
        + 132 * 128 * 128 * 4
    assert _ik_moe_op_pool("down", 4096, m, 132) == 2 * R * 4 + 640 + R * 32 * 36 + 128 * 144 \
        + 132 * 128 * 128 * 4
    # past mmq_id_thresh * n_expert = 4096 tokens the per-expert loop holds F32 copies: more at 4097 than at 4096
    assert _ik_moe_op_pool("fused", 4097, m, 132) > _ik_moe_op_pool("fused", 4096, m, 132)
    # token generation: MMVQ, a few KiB
    assert _ik_moe_op_pool("fused", 1, m, 132) < 64 * 1024


def test_ik_moe_pool_is_on_the_gpu_that_runs_the_moe_ops():
    from runtime.synth import uniform_recipe
    from planner.archs import build_inventory
    inv = build_inventory(load_preset("Qwen3-30B-A3B").spec, uniform_recipe("Q4_0"), name="q", source="q")
    hw = load_hardware("gpu-box")
    k = Knobs(n_ctx=4096, n_batch=4096, n_ubatch=4096)
    sweep = (1, 4096)                                   # llama-sweep-bench's batches; flash attention: 68 -> 70 MiB

    def pool(where, knobs=k, batches=sweep):
        return pool_bytes(inv, Plan("q", {t.name: where(t) for t in inv.allocated()}, knobs, "ik"), hw, batches)

    gpu = pool(lambda t: "CUDA0")
    assert gpu == {"CUDA0": 274 * MiB}
    ram = lambda t: "CPU" if t.is_expert or t.role == "token_embd" else "CUDA0"    # noqa: E731
    assert pool(ram) == {"CUDA0": 274 * MiB}            # MoE op offload uploads the experts for the batch
    no_moe = OffloadPolicy(moe_matmul=OpRule(False), moe_fused_up_gate=OpRule(False))
    assert pool(ram, replace(k, offload=no_moe)) == {"CUDA0": 70 * MiB}          # -op 28,0,31,0
    assert pool(ram, replace(k, rtr=True)) == {"CUDA0": 70 * MiB}                # -rtr: no op offload
    assert pool(ram, replace(k, fmoe=False)) == {"CUDA0": 82 * MiB}              # MUL_MAT_ID one at a time
    # ik offloads a MoE op from batch * 8 >= min_batch * 128: at min_batch 256 only from 4096 tokens
    assert pool(ram, replace(k, offload=OffloadPolicy.all(min_batch=256))) == {"CUDA0": 274 * MiB}
    assert pool(ram, replace(k, n_ubatch=4095, offload=OffloadPolicy.all(min_batch=256)), (1, 4095)) == \
        {"CUDA0": 70 * MiB}
    # experts on a second GPU: their ops run there, the attention stays with the layers' homes. The one-GPU
    # profile does not know CUDA1 (128 SMs assumed): 32 x 6 x 128 tiles divide evenly, no fixup, 264.3 MiB
    split = pool(lambda t: "CUDA1" if t.is_expert else "CUDA0")
    assert split == {"CUDA0": 70 * MiB, "CUDA1": 266 * MiB}
    # a server runs every batch size: flash attention's 266 MiB at 2048 tokens on CUDA0
    assert pool(lambda t: "CUDA1" if t.is_expert else "CUDA0", batches=None) == \
        {"CUDA0": 266 * MiB, "CUDA1": 266 * MiB}
    assert pool_bytes(inv, Plan("q", {t.name: "CUDA0" for t in inv.allocated()}, k), hw) == {}   # mainline


def test_ik_pool_is_on_the_gpus_that_run_attention():
    inv = f32_inventory(qwen3moe_spec())
    gpu = _plan(inv, lambda t: "CPU" if t.is_expert or t.role == "token_embd" else "CUDA0", Knobs(n_ctx=512),
                "ik")
    # tiny: 4 heads of 16, 2 KV heads (ncols2 2, 64 columns a tile); 512 tokens make 16 x 2 = 32 tiles, far from
    # a wave of 2 x 128 blocks (no profile: DEFAULT_N_SM): stream-k, 256 * 64 * (4 + 16) * 4 float2 = 10 MiB
    assert pool_bytes(inv, gpu) == {"CUDA0": 10 * MiB}
    rep = estimate(inv, gpu)
    assert rep.devices["CUDA0"].pool == 10 * MiB and rep.devices["CPU"].pool == 0
    assert rep.devices["CUDA0"].total == sum(rep.devices["CUDA0"].to_dict()[k]
                                             for k in ("weights", "kv", "compute", "overhead", "pool"))
    # the H100 profile's 132 SMs: 264 blocks, 10.3 MiB -> 12
    assert pool_bytes(inv, gpu, load_hardware("gpu-box")) == {"CUDA0": 12 * MiB}
    assert pool_bytes(inv, replace(gpu, dialect="mainline")) == {}                        # mainline: in overhead
    # attention on the CPU (-nkvo) or not flash attention: no attention term. The RAM experts' MoE ops still run
    # on CUDA0 (op offload from 32 * 4 / 2 = 64 tokens): F32 experts take ik's per-expert loop, whose F32 copies
    # (tokens, up and gate results, the fused down's result, row mapping: 456 KiB at 512 tokens) map one 2 MiB step
    no_moe_offload = OffloadPolicy(moe_matmul=OpRule(False), moe_fused_up_gate=OpRule(False))
    for knobs in (Knobs(n_ctx=512, no_kv_offload=True), Knobs(n_ctx=512, flash_attn=False)):
        assert pool_bytes(inv, replace(gpu, knobs=knobs)) == {"CUDA0": 2 * MiB}
        assert pool_bytes(inv, replace(gpu, knobs=replace(knobs, offload=no_moe_offload))) == {}
        assert pool_bytes(inv, replace(gpu, knobs=replace(knobs, n_ubatch=63))) == {}     # below the threshold
    assert pool_bytes(inv, _plan(inv, lambda t: "CPU", Knobs(n_ctx=512), "ik")) == {}


def _ops(inv, dialect, **kw):
    from collections import Counter
    from planner.llama_graph import GraphParams, build_graph
    g = build_graph(inv, GraphParams(512, 512, True, "f16", "f16", (512,) * inv.n_layer, dialect=dialect, **kw))
    return g, Counter(t.op for t in g.nodes)


def test_ik_graph_fuses_the_moe_ffn_and_the_norms():
    """ik_llama.cpp's graph (llama-build-context.cpp llm_build_moe_ffn, llm_build_norm): per MoE layer one
    MOE_FUSED_UP_GATE [n_ff, n_used, T] and one MUL_MULTI_ADD [n_embd, T] where mainline has up, gate, GLU, the
    weighted MUL into [n_embd, n_used, T] and n_used - 1 ADDs; RMS norm and weight in one op; nothing flagged as a
    graph output; no KV-store index inputs."""
    from planner.ggml_graph import OUTPUT
    inv = f32_inventory(qwen3moe_spec())
    n = inv.n_layer
    g, ops = _ops(inv, "ik")
    assert ops["MOE_FUSED_UP_GATE"] == n and ops["MUL_MAT_ID"] == n and ops["MUL_MULTI_ADD"] == n
    assert not ops["GLU"] and not ops["RMS_NORM"] and not ops["MUL"] and not ops["CLAMP"]
    assert ops["FUSED_RMS_NORM"] == 4 * n + 1                    # attn, q, k, ffn per layer, the output
    shapes = {t.op: t.ne for t in g.nodes if t.op in ("MOE_FUSED_UP_GATE", "MUL_MULTI_ADD")}
    assert shapes == {"MOE_FUSED_UP_GATE": (32, 2, 512, 1), "MUL_MULTI_ADD": (64, 512, 1, 1)}
    assert not any(t.flags & OUTPUT for t in g.nodes)
    assert not any("idxs" in t.name for t in g.leafs)
    _, ml = _ops(inv, "mainline")
    assert ml["MUL_MAT_ID"] == 3 * n and ml["GLU"] == n and ml["MUL"] == 5 * n + 1
    # -no-fmoe: both MUL_MAT_IDs and FUSED_MUL_UNARY(gate, up), three [n_ff, n_used, T] tensors
    _, nofmoe = _ops(inv, "ik", fmoe=False)
    assert nofmoe["MUL_MAT_ID"] == 3 * n and nofmoe["FUSED_MUL_UNARY"] == n and not nofmoe["MOE_FUSED_UP_GATE"]


def test_ik_reserves_its_compute_buffers_with_every_op_offloaded():
    """ik applies -op after sizing its buffers (src/llama.cpp:8672-8683): with the MoE ops' offload off, CUDA0
    still holds what the reservation with it on needed (the experts' copies), while the CPU's grows to what the
    MoE ops need when they run there. Mainline sizes them with its op offload setting."""
    inv = f32_inventory(qwen3moe_spec(n_vocab=32, n_expert=8, n_ff_exp=512))    # 1 MiB experts, a tiny output
    ram = lambda t: "CPU" if t.is_expert or t.role == "token_embd" else "CUDA0"  # noqa: E731
    off = OffloadPolicy(moe_matmul=OpRule(False), moe_fused_up_gate=OpRule(False))
    k = Knobs(n_ctx=512, n_ubatch=256)                   # ik offloads MoE ops from 32 * 8 / 2 = 128 tokens
    ik_on, ik_off = (compute_bytes(inv, _plan(inv, ram, replace(k, offload=p), "ik")) for p in (OffloadPolicy(), off))
    assert ik_off["CUDA0"] == ik_on["CUDA0"] > 3 * MiB and ik_off["CPU"] > ik_on["CPU"]
    ml_on, ml_off = (compute_bytes(inv, _plan(inv, ram, replace(k, offload=p))) for p in (OffloadPolicy(), off))
    assert ml_off["CUDA0"] < MiB < ml_on["CUDA0"]


def _mla(inv, n_tokens=512, cells=512, fa=True, tk="f16", tv="f16", dialect="ik", **kw):
    from collections import Counter
    from planner.llama_graph import GraphParams, build_graph
    g = build_graph(inv, GraphParams(n_tokens, n_tokens, fa, tk, tv, (cells,) * inv.n_layer, dialect=dialect, **kw))
    return g, Counter(t.op for t in g.nodes)


def _shapes(g, op, name=None):
    return [t.ne[:3] for t in g.nodes if t.op == op and (name is None or t.name == name)]


def test_ik_mla_graphs():
    """ik's MLA attention (src/graphs/build_deepseek2.cpp:720-1232, planner/mla_graph.py IK_MLA) on 2 layers of 4
    heads (nope 64 + rope 64, v 64, kv_lora 512): which path each -mla / flash attention / batch gets, and how
    -amb splits the heads. Checked byte for byte against ik's CPU build in tests/runtime/test_ik_binaries.py."""
    inv = f32_inventory(deepseek2_spec())
    n = inv.n_layer
    # -mla 3 (and 2), flash attention, >= 128 tokens: K and V decompressed by wkv_b [512, 4 * (64 + 64)]
    for mla in (3, 2):
        g, ops = _mla(inv, mla=mla)
        assert _shapes(g, "MUL_MAT", "kv_f32") == [(512, 512, 1)] * n             # 4 heads * 128 x cells
        assert _shapes(g, "FLASH_ATTN_EXT") == [(64, 4, 512)] * n                  # v x heads x tokens
        assert ops["REPEAT"] == n and ops["CPY"] == 3 * n       # K's rope part; K and V cast; the cache store
        assert _shapes(g, "REPEAT") == [(64, 512, 4)] * n and {t.dtype for t in g.nodes if t.op == "REPEAT"} == {"f16"}
    # -amb: kv_f32 would be 8 MiB at 4096 cells; 4 MiB takes two groups of 2 heads, 1 MiB one head at a time
    for amb, groups in ((0, 1), (8, 1), (4, 2), (1, 4)):
        g, ops = _mla(inv, cells=4096, mla=3, amb=amb)
        assert _shapes(g, "FLASH_ATTN_EXT") == [(64, 4 // groups, 512)] * groups * n, amb
        assert _shapes(g, "CONCAT", "kqv_cat") == [(64 * 4 // groups * i, 512, 1) for i in range(2, groups + 1)] * n
    # a CPU build repeats and casts in the cache type; a GPU build in F16, the quantized rope part cast first
    g, _ = _mla(inv, mla=3, tk="q8_0", tv="q8_0")
    assert {t.dtype for t in g.nodes if t.op in ("REPEAT", "CPY") and not t.name.endswith("(cpy)")} == {"q8_0"}
    g, _ = _mla(inv, mla=3, tk="q8_0", tv="q8_0", gpu_build=True)
    assert {t.dtype for t in g.nodes if t.op in ("REPEAT", "CPY") and not t.name.endswith("(cpy)")} == {"f16"}
    assert _shapes(g, "CPY", "kv_cache_rope_f16") == [(64, 512, 1)] * n
    # -mla 1/3, flash attention, fewer tokens (or -mla 1 at any batch): attention over the latent cache itself
    for mla, tokens in ((3, 32), (1, 512)):
        g, ops = _mla(inv, n_tokens=tokens, mla=mla)
        assert _shapes(g, "MUL_MAT", "q_nope2") == [(512, tokens, 4)] * n            # q_nope absorbed by wk_b
        assert _shapes(g, "FLASH_ATTN_EXT") == [(512, 4, tokens)] * n and not ops["REPEAT"]
        assert _shapes(g, "MUL_MAT", "kqv") == [(64, tokens, 4)] * n                # then wv_b
    # no flash attention (-mla 2 with it below 128 tokens too): KQ, softmax, KQV; -mla 2/3 copy the transposed
    # latent into the buffer, -mla 1 reads kv^T from its V cache
    for mla, fa, tokens in ((3, False, 512), (2, True, 32), (1, False, 32)):
        g, ops = _mla(inv, n_tokens=tokens, mla=mla, fa=fa)
        assert _shapes(g, "SOFT_MAX") == [(512, tokens, 4)] * n and not ops["FLASH_ATTN_EXT"]
        assert _shapes(g, "CONT", "kv_cache_trans") == ([(512, 512, 1)] * n if mla > 1 else [])
    # -amb without flash attention: KQ would be 32 MiB (4096 cells x 512 tokens x 4 heads); 10 MiB: 4 steps
    g, ops = _mla(inv, cells=4096, mla=3, fa=False, amb=10)
    assert _shapes(g, "SOFT_MAX") == [(4096, 512, 1)] * 4 * n
    assert _shapes(g, "CONCAT", "kqv_compressed") == [(512, 512, heads) for heads in (2, 3, 4)] * n
    # -mla 0: K and V of every head stored in full, attention over them
    g, ops = _mla(inv, mla=0)
    assert _shapes(g, "MUL_MAT", "kv") == [(512, 512, 1)] * n
    assert _shapes(g, "FLASH_ATTN_EXT") == [(64, 4, 512)] * n
    assert [t.ne[:2] for t in g.nodes if t.op == "CPY"] == [(128, 2048), (256 * 512, 1)] * n   # K, V stores
    # mainline's graph is unchanged: one flash attention over the latent, V a view of K
    g, ops = _mla(inv, dialect="mainline")
    assert _shapes(g, "FLASH_ATTN_EXT") == [(512, 4, 512)] * n and not ops["REPEAT"] and not ops["CPY"]


def test_ik_runs_mla_3_when_the_blocks_are_split_between_ram_and_a_gpu():
    """ik turns -mla 1/2 (and 0) into 3 when 0 < -ngl < n_layer (src/llama.cpp:8215-8224): KV, compute and the
    computed wkv_b follow."""
    inv = f32_inventory(deepseek2_spec(n_layer=3))
    split = _plan(inv, lambda t: "CUDA0" if t.layer is not None and t.layer >= 1 or t.role == "output" else "CPU",
                  Knobs(n_ctx=512, mla=1, flash_attn=False), "ik")
    gpu = replace(split, assignment={t.name: "CPU" if t.role == "token_embd" else "CUDA0" for t in inv.allocated()})
    assert ik_mla_plan(inv, split).knobs.mla == 3 and ik_mla_plan(inv, gpu).knobs.mla == 1
    as3 = replace(split, knobs=replace(split.knobs, mla=3))
    # c^KV alone, 576 f16 a cell; -mla 1 would add kv^T, 512 f16 a cell
    assert kv_bytes(inv, split) == kv_bytes(inv, as3) == {"CPU": 512 * 1152, "CUDA0": 2 * 512 * 1152}
    assert kv_bytes(inv, gpu) == {"CUDA0": 3 * 512 * (1152 + 1024)}
    # -mla 0 (all on the GPU): K and V of every head, their sizes from attn_k_b / attn_v_b (nope 64 + rope 64, v 64)
    assert kv_layer_bytes(inv, Knobs(n_ctx=512, mla=0), 0, "ik") == 512 * 4 * (128 + 64) * 2
    assert compute_bytes(inv, split) == compute_bytes(inv, as3)
    assert ik_wkv_b_bytes(inv, split) == {"CPU": 512 * 544, "CUDA0": 2 * 512 * 544} and not ik_wkv_b_bytes(inv, gpu)


def test_ik_computes_wkv_b_for_mla_2_and_3():
    """A mainline-converted DeepSeek has attn_k_b and attn_v_b only; for -mla 0/2/3 ik builds attn_kv_b from them
    at load (Q8_0 when quantized): 128 * (128 + 128) rows of 512 -> 17 MiB a layer, 1.01 GiB for DeepSeek-V3, on
    attn_k_b's device, never mapped from the file."""
    inv = load_preset("DeepSeek-V3").inventory()
    where = {t.name: "CPU" if t.is_expert or t.role == "token_embd" else "CUDA0" for t in inv.allocated()}
    plan = Plan("ds", where, Knobs(n_ctx=1024), "ik")
    assert ik_wkv_b_bytes(inv, plan) == {"CUDA0": 61 * 128 * 256 * 544}
    mla1 = replace(plan, knobs=replace(plan.knobs, mla=1))
    assert weight_bytes(inv, plan)["CUDA0"] - weight_bytes(inv, mla1)["CUDA0"] == 61 * 128 * 256 * 544
    assert weight_bytes(inv, replace(plan, dialect="mainline")) == weight_bytes(inv, mla1)
    ram = Plan("ds", {t.name: "CPU" for t in inv.allocated()}, Knobs(n_ctx=1024), "ik")
    assert estimate(inv, ram).host_pinned == 61 * 128 * 256 * 544


def test_ik_amb_splits_attention_without_gqa_into_heads():
    """ik's llm_build_kqv without flash attention: KQ above -amb MiB with as many K/V heads as Q heads runs one
    head at a time (llama-build-context.cpp:2127, :2188-2226); GQA, flash attention and mainline are not split."""
    mha = f32_inventory(qwen3moe_spec(n_head_kv=(4, 4)))          # KQ: 1024 cells x 512 tokens x 4 heads = 8 MiB
    for inv, fa, amb, dialect, split in ((mha, False, 4, "ik", True), (mha, False, 8, "ik", False),
                                         (mha, True, 4, "ik", False), (mha, False, 4, "mainline", False),
                                         (f32_inventory(qwen3moe_spec()), False, 4, "ik", False)):
        g, _ = _mla(inv, cells=1024, fa=fa, amb=amb, dialect=dialect)
        n_head_kv = inv.hparams.n_head_kv[0]
        want = [] if fa else [(1024, 512, 1)] * 4 * 2 if split else [(1024, 512, 4)] * 2
        kq = [t.ne[:3] for t in g.nodes if t.op == "SOFT_MAX" and t.name.startswith("kq")]
        assert kq == want, (n_head_kv, fa, amb, dialect)
