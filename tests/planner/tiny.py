"""Tiny hand-countable inventories for planner tests (F32 everywhere: nbytes = 4 * elements)."""
from __future__ import annotations

from planner.archs import ArchSpec, build_inventory
from planner.model import Hparams, ModelInventory


def qwen3moe_spec(n_layer: int = 2, **kw) -> ArchSpec:
    hp = dict(arch="qwen3moe", n_layer=n_layer, n_embd=64, n_vocab=256, n_head=4, n_head_kv=(2,) * n_layer,
              head_dim_k=16, head_dim_v=16, n_ctx_train=4096, n_expert=4, n_expert_used=2, n_ff_exp=32,
              moe_layers=(True,) * n_layer, swa_layers=(False,) * n_layer, n_rot=16)
    hp.update(kw)
    return ArchSpec(Hparams(**hp), frozenset({"qk_norm"}))


def f32_inventory(spec: ArchSpec, tied_output: bool = False) -> ModelInventory:
    return build_inventory(spec, lambda name, shape, layer: "F32", tied_output=tied_output, name="tiny",
                           source="tiny")


# Bytes of the tiny qwen3moe above, counted by hand:
#   per layer, non-expert: attn_norm 64*4=256, attn_q 64*64*4=16384, attn_k 64*32*4=8192, attn_v 8192,
#   attn_output 16384, q_norm/k_norm 16*4=64 each, ffn_norm 256, ffn_gate_inp 64*4*4=1024  -> 50816
#   per layer, experts: gate/up [64,32,4] and down [32,64,4] = 32768 each -> 98304
#   globals: token_embd [64,256] 65536, output_norm 256, output 65536
LAYER_DENSE = 50816
LAYER_EXPERTS = 98304
TOKEN_EMBD = OUTPUT = 65536
OUTPUT_NORM = 256


def deepseek2_spec(n_layer: int = 2, n_head: int = 4, **kw) -> ArchSpec:
    """MLA as mainline converts DeepSeek (one KV head of kv_lora 512 + rope 64), ik's widths; layer 0 dense."""
    hp = dict(arch="deepseek2", n_layer=n_layer, n_embd=64, n_vocab=256, n_head=n_head, n_head_kv=(1,) * n_layer,
              head_dim_k=576, head_dim_v=512, n_ctx_train=4096, n_ff=128, n_expert=4, n_expert_used=2, n_ff_exp=32,
              n_expert_shared=1, n_ff_shexp=32, moe_layers=(False,) + (True,) * (n_layer - 1),
              swa_layers=(False,) * n_layer, mla_kv_lora_rank=512, n_rot=64)
    hp.update(kw)
    return ArchSpec(Hparams(**hp), frozenset({"probs_b"}), q_lora_rank=64, head_dim_k_mla=128, head_dim_v_mla=64)
