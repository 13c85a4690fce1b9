"""The BF16 recipe: what convert_hf_to_gguf.py --outtype bf16 writes (every 2-D+ .weight BF16; 1-D tensors, norms,
routers and biases F32), for every preset; the torch engine holds weights in that form (bf16, routers/norms f32)."""
from __future__ import annotations

import pytest

from planner.errors import InputError
from planner.loader import load_model
from planner.presets import load_preset, preset_names


def test_qwen3_30b_a3b_bf16_types_and_bytes_by_hand():
    inv = load_model("preset:Qwen3-30B-A3B:BF16")
    assert load_preset("qwen3-30b-a3b:BF16").quant == "BF16" and inv.source == "preset:Qwen3-30B-A3B:BF16"
    types = {t.name: t.ggml_type for t in inv.tensors if t.layer in (None, 0)}
    assert types == {
        "token_embd.weight": "BF16", "output_norm.weight": "F32", "output.weight": "BF16",
        "blk.0.attn_norm.weight": "F32", "blk.0.attn_q.weight": "BF16", "blk.0.attn_k.weight": "BF16",
        "blk.0.attn_v.weight": "BF16", "blk.0.attn_output.weight": "BF16", "blk.0.attn_q_norm.weight": "F32",
        "blk.0.attn_k_norm.weight": "F32", "blk.0.ffn_norm.weight": "F32",
        "blk.0.ffn_gate_inp.weight": "F32",           # the router: F32 in the converter and in the torch engine
        "blk.0.ffn_gate_exps.weight": "BF16", "blk.0.ffn_up_exps.weight": "BF16", "blk.0.ffn_down_exps.weight": "BF16",
    }
    # D 2048, vocab 151936, 48 layers, q 32x128, kv 4x128, 128 experts of 768:
    # embd + output 2 x 2048 x 151936 BF16; per layer q,k,v,o 18,874,368 and experts 3 x 128 x 2048 x 768 BF16,
    # router 2048 x 128 and norms 2048 + 2048 + 128 + 128 F32; output_norm 2048 F32.  (The published
    # Qwen3-30B-A3B-BF16.gguf is 61.1 GB.)
    by_hand = 2 * (2 * 2048 * 151936) + 48 * (2 * (18_874_368 + 3 * 128 * 2048 * 768) + 4 * (2048 * 128 + 4352)) \
        + 4 * 2048
    assert by_hand == 61_089_832_960
    assert sum(t.nbytes for t in inv.tensors) == by_hand


@pytest.mark.parametrize("name", preset_names())
def test_every_preset_has_bf16(name):
    inv = load_preset(f"{name}:BF16").inventory()
    for t in inv.tensors:
        f32 = len(t.shape) == 1 or ".ffn_gate_inp" in t.name or not t.name.endswith(".weight")   # routers
        assert t.ggml_type == ("F32" if f32 else "BF16"), t.name


def test_unknown_quant_lists_bf16_among_the_available():
    with pytest.raises(InputError, match=r"available: Q4_K_M, Q8_0, BF16"):
        load_preset("Qwen3-30B-A3B:Q9_9")
