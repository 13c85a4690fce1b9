"""Presets expand to full inventories whose sizes match the published GGUF files of those models."""
from __future__ import annotations

import pytest

from planner.errors import InputError
from planner.loader import load_model
from planner.presets import load_preset, preset_names

# Published file sizes (GB = 1e9) of common GGUF releases, +-6%: our recipes are "Q4_K_M-like", not byte-exact.
PUBLISHED = {
    "Qwen3-30B-A3B:Q4_K_M": 18.6e9, "Qwen3-235B-A22B:Q4_K_M": 142.6e9, "DeepSeek-V3:Q4_K_M": 404.4e9,
    "gpt-oss-20b:MXFP4": 12.1e9, "gpt-oss-120b:MXFP4": 63.4e9, "GLM-4.5-Air:Q4_K_M": 72.9e9,
    "Llama-4-Scout-17B-16E:Q4_K_M": 65.4e9, "DeepSeek-V2-Lite:Q4_K_M": 10.4e9,
}


def test_all_eight_presets_exist():
    assert set(preset_names()) == {"DeepSeek-V3", "DeepSeek-V2-Lite", "Qwen3-30B-A3B", "Qwen3-235B-A22B",
                                   "gpt-oss-20b", "gpt-oss-120b", "GLM-4.5-Air", "Llama-4-Scout-17B-16E"}


@pytest.mark.parametrize("name,size", sorted(PUBLISHED.items()))
def test_preset_size_close_to_published(name, size):
    inv = load_model(f"preset:{name}")
    file_like = sum(t.nbytes for t in inv.tensors)   # the file also holds NextN tensors
    assert abs(file_like - size) / size < 0.06, (name, file_like / 1e9)


def test_deepseek_v3_inventory_shape():
    inv = load_preset("DeepSeek-V3:Q4_K_M").inventory()
    hp = inv.hparams
    assert len(inv.tensors) > 1000
    assert hp.is_mla and hp.mla_kv_lora_rank == 512 and hp.n_rot == 64
    assert inv.moe_layers() == list(range(3, 61))          # 3 dense leading layers
    down = inv.by_name["blk.3.ffn_down_exps.weight"]
    assert down.shape == (2048, 7168, 256) and down.role == "exps_down"
    assert "blk.3.exp_probs_b.bias" in inv.by_name
    assert inv.by_name["output.weight"].ggml_type == "Q6_K"
    assert inv.by_name["blk.3.ffn_gate_inp.weight"].ggml_type == "F32"


def test_gpt_oss_uses_mxfp4_experts_and_swa_pattern():
    inv = load_preset("gpt-oss-120b").inventory()
    assert inv.by_name["blk.0.ffn_up_exps.weight"].ggml_type == "MXFP4"
    assert inv.by_name["blk.0.attn_q.weight"].ggml_type == "Q8_0"
    assert inv.hparams.swa_layers[:4] == (True, False, True, False) and inv.hparams.n_swa == 128


def test_quant_fallback_when_rows_do_not_fit_the_block():
    # DeepSeek attn_k_b rows are 128 long: Q4_K (block 256) falls back to Q5_0, as llama-quantize does
    inv = load_preset("DeepSeek-V3:Q4_K_M").inventory()
    assert inv.by_name["blk.0.attn_k_b.weight"].ggml_type == "Q5_0"


def test_llama4_interleave_and_chunked_attention():
    inv = load_preset("Llama-4-Scout-17B-16E").inventory()
    assert inv.hparams.swa_layers[:4] == (True, True, True, False) and inv.hparams.n_swa == 8192
    assert len(inv.moe_layers()) == 48


@pytest.mark.parametrize("bad", ["preset:NoSuchModel", "preset:Qwen3-30B-A3B:Q9_9"])
def test_unknown_preset_or_quant_lists_the_known_ones(bad):
    with pytest.raises(InputError, match="known|available"):
        load_model(bad)


def test_leading_dense_block_count_is_read_only_where_the_loader_reads_it():
    """A qwen3moe file that sets leading_dense_block_count loads as llama.cpp's qwen3moe loader reads it (the key
    never read: every layer MoE), where deepseek2 takes its dense lead from it (issue 43 item 7)."""
    import json
    from importlib import resources

    from planner.archs import spec_from_metadata

    def meta(name: str, **extra) -> dict:
        d = json.loads(resources.files("planner.presets").joinpath(f"{name}.json").read_text())
        return {"general.architecture": d["arch"], **{f"{d['arch']}.{k}": v for k, v in {**d["metadata"],
                                                                                         **extra}.items()}}
    qwen = spec_from_metadata(meta("qwen3-30b-a3b", leading_dense_block_count=3)).hparams
    assert len(qwen.moe_layers) == 48 and all(qwen.moe_layers)
    ds = spec_from_metadata(meta("deepseek-v3")).hparams
    assert ds.moe_layers[:4] == (False, False, False, True)
