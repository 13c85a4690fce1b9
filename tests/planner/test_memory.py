"""Memory model on tiny inventories whose bytes are added up by hand (tiny.py), plus preset facts."""
from __future__ import annotations

from dataclasses import replace

import pytest

from planner.hardware import MiB, load_hardware
from planner.memory import (_ik_fattn_pool, compute_bytes, estimate, ik_fattn_pool_bytes, kv_bytes, kv_cells,
                            kv_layer_bytes, pool_bytes, weight_bytes)
from planner.plan import Knobs, OffloadPolicy, Plan
from planner.presets import load_preset, preset_names

from tiny import LAYER_DENSE, LAYER_EXPERTS, OUTPUT, OUTPUT_NORM, TOKEN_EMBD, f32_inventory, qwen3moe_spec


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


@pytest.mark.parametrize("name", preset_names())
def test_reduced_graph_gives_the_full_graph_peaks(name):
    # compute_bytes builds only a few layers of each run of identical layers; the peaks must not change
    inv = load_preset(name).inventory()
    n = inv.n_layer - inv.hparams.n_nextn
    plans = [
        _plan(inv, lambda t: "CPU", Knobs(n_ctx=8192, n_ubatch=512)),
        _plan(inv, lambda t: "CPU" if t.is_expert or t.role == "token_embd" else "CUDA0",
              Knobs(n_ctx=4096, n_ubatch=2048, n_batch=2048, flash_attn=False)),
        _plan(inv, lambda t: "CUDA0" if t.layer is None and t.role != "token_embd"
              or (t.layer is not None and t.layer >= n - 6) else "CPU", Knobs(n_ctx=8192, n_ubatch=1024)),
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
    assert pool_bytes(inv, replace(gpu, knobs=Knobs(n_ctx=512, no_kv_offload=True))) == {}  # attention on the CPU
    assert pool_bytes(inv, replace(gpu, knobs=Knobs(n_ctx=512, flash_attn=False))) == {}
    assert pool_bytes(inv, _plan(inv, lambda t: "CPU", Knobs(n_ctx=512), "ik")) == {}
