"""Tiny models and placements for the torch-engine tests (logical GPUs on the CPU; CUDA where present)."""
from __future__ import annotations

from collections.abc import Callable

import torch

from planner.archs import build_inventory
from planner.model import ModelInventory
from planner.plan import Knobs, OffloadPolicy, OpRule, Plan
from runtime.synth import tiny_spec, uniform_recipe
from runtime.torch_engine.reference import reference_logits, reference_weights

ARCHS = ("qwen3moe", "qwen2moe", "deepseek2", "gpt-oss")


def tiny_inventory(arch: str, **overrides) -> ModelInventory:
    """runtime.synth's tiny model of `arch`; gpt-oss with a 4-token window so that 8-token prompts are masked."""
    if arch == "gpt-oss":
        overrides.setdefault("n_swa", 4)
    return build_inventory(tiny_spec(arch, **overrides), uniform_recipe("Q8_0"), name=f"tiny-{arch}", source="")


Assign = Callable[[ModelInventory], dict[str, str]]


def _layer_of(name: str) -> int | None:
    return int(name.split(".")[1]) if name.startswith("blk.") else None


def all_gpu(inv: ModelInventory) -> dict[str, str]:
    """-ngl 99: everything on CUDA0 but token_embd (llama.cpp keeps it on the CPU)."""
    return {t.name: "CPU" if t.role == "token_embd" else "CUDA0" for t in inv.allocated()}


def experts_in_ram(inv: ModelInventory) -> dict[str, str]:
    """-ngl 99 -cmoe: routed experts of every layer in RAM."""
    return {n: ("CPU" if inv.by_name[n].is_expert else d) for n, d in all_gpu(inv).items()}


def two_gpus(inv: ModelInventory) -> dict[str, str]:
    """Layers split over CUDA0 and CUDA1, the output layer on CUDA1, layer 0's experts in RAM."""
    out = {}
    for t in inv.allocated():
        layer = _layer_of(t.name)
        if t.role == "token_embd" or layer == 0 and t.is_expert:
            out[t.name] = "CPU"
        elif layer is None or layer >= inv.n_layer // 2:
            out[t.name] = "CUDA1"
        else:
            out[t.name] = "CUDA0"
    return out


def all_cpu(inv: ModelInventory) -> dict[str, str]:
    """-ngl 0."""
    return {t.name: "CPU" for t in inv.allocated()}


def split_experts(inv: ModelInventory) -> dict[str, str]:
    """Only ffn_gate_exps in RAM (an -ot that splits a layer's experts between devices)."""
    return {n: ("CPU" if ".ffn_gate_exps." in n else d) for n, d in all_gpu(inv).items()}


def first_layer_cpu(inv: ModelInventory) -> dict[str, str]:
    """-ngl n_layer (mainline: output first): block 0 entirely on the CPU, KV cache included."""
    return {n: ("CPU" if _layer_of(n) == 0 else d) for n, d in all_gpu(inv).items()}


def knobs(min_batch: int = 32, enabled: bool = True, only_active: bool = True, **kw) -> Knobs:
    return Knobs(n_ctx=512, n_ubatch=64, n_threads=1, offload=OffloadPolicy.all(enabled, min_batch),
                 only_active_experts=only_active, **kw)


# (label, assignment, knobs): >= 5 placements and offload policies per architecture
PLACEMENTS: list[tuple[str, Assign, Knobs]] = [
    ("all_gpu", all_gpu, knobs()),
    ("experts_in_ram", experts_in_ram, knobs()),
    ("experts_in_ram_offload_active", experts_in_ram, knobs(min_batch=4)),
    ("experts_in_ram_offload_full", experts_in_ram, knobs(min_batch=4, only_active=False)),
    ("two_gpus", two_gpus, knobs()),
    ("all_cpu_offload_everything", all_cpu, knobs(min_batch=1)),
    ("split_experts", split_experts, knobs(min_batch=4)),
    ("first_layer_cpu_no_offload", first_layer_cpu, knobs(enabled=False)),
]


def plan_for(inv: ModelInventory, assign: Assign, k: Knobs) -> Plan:
    return Plan(inv.name, assign(inv), k)


def untied_prompt(inv: ModelInventory, engine_model, n: int,
                  seeds: range = range(40)) -> tuple[list[int], torch.Tensor]:
    """A prompt whose routing has no near-ties (every top-k margin > 0.02 in logit units), and the reference
    logits for it in the engine's dtype: bf16 rounding cannot flip an expert choice on it."""
    W = reference_weights(inv, engine_model.rt.source, engine_model.dtype)
    for seed in seeds:
        g = torch.Generator().manual_seed(seed)
        toks = torch.randint(0, inv.hparams.n_vocab, (n,), generator=g).tolist()
        margins: list[float] = []
        ref = reference_logits(engine_model.cfg, W, toks, round_to=engine_model.dtype, margins=margins)
        if not margins or min(margins) > 0.02:
            return toks, ref
    raise AssertionError("no prompt without routing near-ties found")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm())


__all__ = ["ARCHS", "PLACEMENTS", "tiny_inventory", "plan_for", "knobs", "untied_prompt", "rel", "OpRule",
           "all_gpu", "experts_in_ram", "two_gpus", "all_cpu", "split_experts", "first_layer_cpu"]
