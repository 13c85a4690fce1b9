"""Op offload as ggml's scheduler does it, read from the torch engine's counters (logical GPUs on the CPU)."""
from __future__ import annotations

from planner.engine_contract import BenchRun
from runtime.torch_engine import TorchEngine
from runtime.torch_engine.reference import reference_logits, reference_weights
from torch_plans import all_gpu, experts_in_ram, knobs, plan_for, tiny_inventory

TOKENS = list(range(3, 3 + 40))


def _model(only_active: bool = True, min_batch: int = 32):
    inv = tiny_inventory("qwen3moe", n_expert=32)      # 32 tokens x top-2 leave some of 32 experts unrouted
    engine = TorchEngine(compute_dtype="fp32", device_map="logical")
    return inv, engine.load(inv, plan_for(inv, experts_in_ram, knobs(min_batch=min_batch, only_active=only_active)),
                            min_cells=64)


def test_min_batch_32_ubatch_31_uploads_nothing_and_32_uploads() -> None:
    inv, model = _model()
    model.forward(TOKENS[:31], 0, n_out=31)      # every layer sees a batch of 31 < 32: experts run on the CPU
    assert model.counters.upload_bytes == 0
    assert model.counters.ops["moe_matmul@CPU"] == 2 and model.counters.offloaded["moe_matmul"] == 0
    model.counters.clear()
    model.forward(TOKENS[:32], 0, n_out=32)      # 32 >= 32: the expert ops run on CUDA0, weights uploaded
    assert model.counters.upload_bytes > 0
    assert model.counters.ops["moe_matmul@CUDA0"] == 2 and model.counters.offloaded["moe_matmul"] == 2
    model.close()


def test_last_layer_sees_only_the_output_rows() -> None:
    """llama.cpp drops the non-output rows after the last layer's attention: its FFN batch is n_out (1 in
    llama-bench's prompt runs), so that layer's experts stay on the CPU even in a 32-token ubatch."""
    inv, model = _model()
    model.forward(TOKENS[:32], 0, n_out=1)
    assert model.counters.ops["moe_matmul@CUDA0"] == 1 and model.counters.ops["moe_matmul@CPU"] == 1
    model.close()


def _expert_bytes(model, layer: int) -> int:
    return sum(model.weights.get(f"blk.{layer}.ffn_{p}_exps.weight").element_size()
               * model.weights.get(f"blk.{layer}.ffn_{p}_exps.weight").numel() for p in ("gate", "up", "down"))


def test_only_active_experts_upload_exactly_the_routed_experts() -> None:
    inv, model = _model(only_active=True)
    tokens = TOKENS[:32]
    routes: dict[int, set[int]] = {}
    reference_logits(model.cfg, reference_weights(inv, model.rt.source, model.dtype), tokens, routes=routes)
    model.forward(tokens, 0, n_out=32)
    n_expert = inv.hparams.n_expert
    expected = sum(len(routes[il]) * _expert_bytes(model, il) // n_expert for il in routes)
    assert model.counters.upload_bytes == expected
    expected_file = sum(len(routes[il]) / n_expert * inv.expert_bytes(il) for il in routes)
    assert abs(model.counters.upload_model_bytes - expected_file) <= 4
    assert any(len(r) < n_expert for r in routes.values())     # the test means something: not all were routed
    model.close()


def test_without_only_active_every_expert_is_uploaded() -> None:
    inv, model = _model(only_active=False)
    model.forward(TOKENS[:32], 0, n_out=32)
    assert model.counters.upload_bytes == _expert_bytes(model, 0) + _expert_bytes(model, 1)
    assert model.counters.upload_model_bytes == inv.expert_bytes(0) + inv.expert_bytes(1)
    model.close()


def test_activations_cross_devices_only_at_segment_boundaries() -> None:
    inv = tiny_inventory("qwen3moe")
    engine = TorchEngine(compute_dtype="fp32", device_map="logical")
    model = engine.load(inv, plan_for(inv, all_gpu, knobs()), min_cells=64)
    model.forward(TOKENS[:8], 0)
    assert model.counters.transfers == 1          # the embedding rows, CPU -> CUDA0; nothing else moves
    model.close()
    model = engine.load(inv, plan_for(inv, experts_in_ram, knobs()), min_cells=64)
    model.forward(TOKENS[:8], 0)
    # per MoE layer: normed input, expert ids and weights to the CPU, the experts' output back
    assert model.counters.transfers == 1 + 2 * 4
    model.close()


def test_over_budget_logical_gpu_fails_like_an_out_of_memory() -> None:
    """fp32 tiny qwen3moe: ~2.4 MiB of non-expert weights and KV, 6 MiB of experts. A 4 MiB logical GPU
    holds the plan with its experts in RAM, not the one with everything on the GPU."""
    inv = tiny_inventory("qwen3moe")
    engine = TorchEngine(compute_dtype="fp32", device_map="logical", logical_gpu_bytes=4 << 20)
    wl = BenchRun(n_prompt=8, n_gen=2, repetitions=1)
    m = engine.measure(inv, plan_for(inv, all_gpu, knobs()), wl)
    assert not m.ok and "out of memory on CUDA0" in m.error
    m = engine.measure(inv, plan_for(inv, experts_in_ram, knobs()), wl)
    assert m.ok, m.error
    assert 2 << 20 < m.peak_bytes["CUDA0"] <= 4 << 20


def test_a_logical_gpu_is_charged_the_two_staging_buffers_per_shape_a_real_gpu_allocates() -> None:
    """The stager alternates two buffers per shape on CUDA (an upload overlaps the previous op). A logical GPU
    charged one, so its accountant (the CPU stand-in's peak, its budget check) missed half of the staging that
    the same plan allocates on a GPU: with both layers' experts offloaded, each shape is staged twice."""
    inv, model = _model(only_active=False)
    model.forward(TOKENS[:32], 0, n_out=32)
    assert model.counters.offloaded["moe_matmul"] == 2
    per_layer = sum(model.weights.buffer(f"blk.0.ffn_{p}_exps.weight").storage.untyped_storage().nbytes()
                    for p in ("gate", "down"))            # the packed gate+up buffer and down's
    parts = model.acct.parts["CUDA0"]
    assert parts["staging"] == 2 * per_layer
    assert parts["weights"] + parts["kv"] + parts["staging"] == model.acct.static["CUDA0"]
    emb = model.weights.get("token_embd.weight")
    assert model.acct.parts["CPU"]["weights"] == sum(_expert_bytes(model, il) for il in range(inv.n_layer)) \
        + emb.numel() * emb.element_size()                # the experts and token_embd: the plan's RAM tensors
    model.close()
    m = TorchEngine(compute_dtype="fp32", device_map="logical").measure(
        inv, plan_for(inv, experts_in_ram, knobs(only_active=False)),
        BenchRun(n_prompt=32, n_gen=2, repetitions=1))
    assert m.ok and m.raw["static_parts"]["CUDA0"]["staging"] == 2 * per_layer
