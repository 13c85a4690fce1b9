"""Weights of the torch engine: GGUF tensors equal gguf-py's dequantization, synthetic weights are
deterministic and device-independent, and a GGUF model runs through the engine as the reference does."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from planner.gguf_header import load_inventory
from runtime.torch_engine import TorchEngine
from runtime.torch_engine.weights import GGUFSource, SyntheticSource, torch_shape
from torch_plans import experts_in_ram, knobs, plan_for, rel, tiny_inventory, untied_prompt

gguf = pytest.importorskip("gguf")

QUANTS = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "MXFP4", "Q4_K", "Q6_K"]
SAMPLE = ["blk.0.ffn_up_exps.weight", "blk.1.attn_q.weight", "blk.0.attn_norm.weight", "output.weight"]


def _gguf_values(path, name: str) -> np.ndarray:
    reader = gguf.GGUFReader(path)
    t = next(t for t in reader.tensors if t.name == name)
    values = gguf.quants.dequantize(t.data, t.tensor_type)
    return np.array(values, dtype=np.float32).reshape(torch_shape(tuple(int(d) for d in t.shape)))


@pytest.mark.parametrize("quant", QUANTS)
def test_gguf_tensors_equal_gguf_dequantize(tiny_gguf, quant: str) -> None:
    path = tiny_gguf("qwen3moe", quant=quant, expert_quant=quant)
    src = GGUFSource(path)
    for name in SAMPLE:
        shape = torch_shape(src.infos[name].shape)
        out = torch.empty(shape, dtype=torch.float32)
        src.fill(name, out)
        assert torch.equal(out, torch.from_numpy(_gguf_values(path, name))), f"{quant} {name}"
        # into bf16 and into a strided (transposed) view: the same values, rounded
        if len(shape) == 3:
            store = torch.empty(shape[0], shape[2], shape[1], dtype=torch.bfloat16)
            src.fill(name, store.transpose(1, 2))
            assert torch.equal(store.transpose(1, 2), out.to(torch.bfloat16))


def test_gguf_model_runs_like_the_reference(tiny_gguf) -> None:
    path = tiny_gguf("qwen2moe", quant="Q4_K", expert_quant="Q5_0")
    inv = load_inventory(path)
    engine = TorchEngine(compute_dtype="fp32", device_map="logical")
    model = engine.load(inv, plan_for(inv, experts_in_ram, knobs(min_batch=4)), min_cells=64)
    assert model.rt.source.kind == "gguf"
    prompt, ref = untied_prompt(inv, model, 6)
    logits, _ = model.forward(prompt, 0, n_out=6)
    assert rel(logits, ref) < 1e-5
    model.close()


def test_synthetic_weights_are_deterministic_per_name_and_device_independent() -> None:
    inv = tiny_inventory("deepseek2")
    a, b = SyntheticSource(inv, seed=3), SyntheticSource(inv, seed=3)
    for name in ("blk.1.ffn_down_exps.weight", "blk.0.attn_kv_a_norm.weight", "token_embd.weight"):
        shape = torch_shape(inv.by_name[name].shape)
        x, y = torch.empty(shape), torch.empty(shape, dtype=torch.float64)
        a.fill(name, x)
        b.fill(name, y)
        assert torch.equal(x.double(), y)
    x = torch.empty(torch_shape(inv.by_name["blk.1.attn_q_b.weight"].shape))
    SyntheticSource(inv, seed=4).fill("blk.1.attn_q_b.weight", x)
    y = torch.empty_like(x)
    a.fill("blk.1.attn_q_b.weight", y)
    assert not torch.equal(x, y)


def test_large_tensors_are_tiled_from_the_pool_with_fresh_offsets(monkeypatch) -> None:
    import runtime.torch_engine.weights as w
    monkeypatch.setattr(w, "SMALL_ELEMENTS", 1000)
    monkeypatch.setattr(w, "POOL_ELEMENTS", 4093)
    inv = tiny_inventory("qwen3moe")
    src = w.SyntheticSource(inv)
    out = torch.empty(torch_shape(inv.by_name["blk.0.ffn_up_exps.weight"].shape))
    src.fill("blk.0.ffn_up_exps.weight", out)
    assert not torch.equal(out[0], out[1])                  # experts differ
    assert 0.5 / 16 < float(out.std()) < 2 / 16             # N(0, 1/fan_in): fan_in 256


def test_zipf_routing_makes_hot_experts() -> None:
    inv = tiny_inventory("qwen3moe", n_expert=32)
    src = SyntheticSource(inv, routing="zipf:1.5")
    bias = src.router_bias(0)
    w = torch.empty(torch_shape(inv.by_name["blk.0.ffn_gate_inp.weight"].shape))
    src.fill("blk.0.ffn_gate_inp.weight", w)
    x = torch.nn.functional.normalize(torch.randn(2000, inv.hparams.n_embd), dim=-1) * 16
    ids = torch.topk(x @ w.T + bias, 2, dim=-1).indices.reshape(-1)
    counts = torch.bincount(ids, minlength=32).float()
    assert counts.max() > 4 * counts.mean()
    assert SyntheticSource(inv, routing="uniform").router_bias(0) is None
