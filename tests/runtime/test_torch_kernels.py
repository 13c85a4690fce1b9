"""Kernel paths of the torch engine against plain loops (CPU; the CUDA-only paths in test_torch_gpu.py)."""
from __future__ import annotations

import torch

from runtime.torch_engine import cpu_moe
from runtime.torch_engine import kernels as K


def _loop_mm(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """torch._grouped_mm's contract, as a loop: group e (rows offs[e-1]..offs[e]) times w[e].T."""
    out = torch.empty(a.shape[0], w.shape[1], dtype=a.dtype)
    start = 0
    for e, end in enumerate(offs.tolist()):
        out[start:end] = a[start:end] @ w[e].T
        start = end
    return out


def _case(T: int = 12, E: int = 8, A: int = 3, D: int = 32, F: int = 24):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, D, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:A] for _ in range(T)])
    w = torch.rand(T, A, generator=g)
    up = torch.randn(E, 2 * F, D, generator=g) / D ** 0.5
    down = torch.randn(E, D, F, generator=g) / F ** 0.5
    return x, ids, w, up, down, F


def test_grouped_experts_sorts_once_and_matches_the_loop() -> None:
    x, ids, w, up, down, F = _case()
    got = K.grouped_experts(x, ids, w, [up], down, F, "silu", mm=_loop_mm)
    want = K._loop_down(K.activation(K._loop_up(x, ids, [up]), F, "silu"), ids, w, down)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    gate, upper = up[:, :F], up[:, F:]      # gate and up in two tensors (placed apart)
    got2 = K.grouped_experts(x, ids, w, [gate.contiguous(), upper.contiguous()], down, F, "silu", mm=_loop_mm)
    assert torch.allclose(got2, want, rtol=1e-5, atol=1e-5)


def test_cpu_gemv_kernel_matches_the_loop() -> None:
    if not cpu_moe.available(torch.float32):
        import pytest
        pytest.skip("no C compiler: cpu_moe falls back to the per-expert loop")
    x, ids, w, up, down, F = _case(T=2)
    y = cpu_moe.moe_up(x, ids, up, threads=1)
    assert torch.allclose(y, K._loop_up(x, ids, [up]), rtol=1e-5, atol=1e-5)
    h = K.activation(y, F, "silu")
    assert torch.allclose(cpu_moe.moe_down(h, ids, w, down, threads=1), K._loop_down(h, ids, w, down),
                          rtol=1e-5, atol=1e-5)
    # bf16 weights, a strided view (the gate rows of a packed buffer); the activations are rounded to bf16
    # (as llama.cpp does), so the reference takes x rounded
    upb = up.to(torch.bfloat16)
    yb = cpu_moe.moe_up(x, ids, upb[:, :F], threads=1)
    assert torch.allclose(yb, K._loop_up(x.bfloat16().float(), ids, [upb[:, :F].float()]), rtol=1e-4, atol=1e-4)
