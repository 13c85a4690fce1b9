"""cpu_moe's C kernels against float64 references, on every bf16 path this machine can build.

With bf16 weights the kernel rounds the activations to bf16 (as llama.cpp does), so against the exact float64
product its error is bounded by that rounding: |x - bf16(x)| <= 2^-9 |x| per element, hence
|y - y64| <= 2^-9 * (|W| @ |x|) plus fp32 summation error. Against the float64 product of the *rounded* x only
fp32 summation error is left. Sizes are odd on purpose: K not a multiple of 32 (the masked tail of the AVX512
loop, alone when K < 32), N not a multiple of 4 (the last quarter of rows short), T > 1, A > 1 and an expert
chosen twice by one token.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runtime.torch_engine import cpu_moe

pytestmark = pytest.mark.skipif(not cpu_moe.available(torch.float32), reason="no C compiler: no cpu_moe kernel")

# T tokens, A active, E experts, N rows, K the dot length
SIZES = [(3, 3, 5, 13, 77), (2, 2, 3, 6, 20), (1, 4, 4, 1, 131), (4, 1, 2, 9, 64)]


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return {f for line in text.splitlines() if line.startswith("flags") for f in line.split(":", 1)[1].split()}


@pytest.fixture(scope="module", params=["built", "portable"])
def kernel(request, tmp_path_factory):
    """The library `available()` uses, then the portable loops (-DCPU_MOE_PORTABLE), built in a scratch cache."""
    if request.param == "built":
        yield None
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OFFLOAD_TUNER_CACHE", str(tmp_path_factory.mktemp("cpu_moe")))
        dll = cpu_moe._build(cpu_moe._compiler(), cpu_moe.BUILD_FLAGS[1])
    assert dll is not None and dll.cpu_moe_bf16_dp() == 0
    yield dll


@pytest.fixture
def use(kernel, monkeypatch):
    if kernel is not None:
        monkeypatch.setattr(cpu_moe, "_library", lambda: kernel)


def _case(T: int, A: int, E: int, N: int, K: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(T * 1000 + K)
    x = torch.randn(T, K, generator=g)
    ids = torch.randint(0, E, (T, A), generator=g)
    if A > 1:
        ids[0, 1] = ids[0, 0]                               # one token picks an expert twice
    wt = torch.rand(T, A, generator=g)
    packed = (torch.randn(E, 2 * N, K, generator=g) / K ** 0.5).to(dtype)
    return x, ids, wt, packed[:, N:]                        # the up rows of a packed [E, 2N, K] buffer (strided)


def _up64(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """[T*A, N] float64: x[t] @ w[ids[t, a]].T, row t*A + a."""
    T, A = ids.shape
    return torch.stack([w[ids[t, a]].double() @ x[t].double() for t in range(T) for a in range(A)])


def _down64(h: torch.Tensor, ids: torch.Tensor, wt: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """[T, N] float64: sum over a of wt[t, a] * w[ids[t, a]] @ h[t*A + a]."""
    T, A = ids.shape
    return torch.stack([sum(wt[t, a].double() * (w[ids[t, a]].double() @ h[t * A + a].double()) for a in range(A))
                        for t in range(T)])


def _assert_bf16_close(got: torch.Tensor, x: torch.Tensor, want, bound) -> None:
    """got against float64 `want(x)`: within bf16 rounding of x for the exact x, fp32 summation for bf16(x)."""
    exact, rounded = want(x), want(x.bfloat16().float())
    scale = bound(x.abs())                                  # |W| @ |x|: what the rounding error is relative to
    err = (got.double() - exact).abs()
    assert (err <= 2.0 ** -8 * scale + 1e-30).all(), f"max error {(err / scale).max():.2e} of |W|@|x|"
    assert err.norm() / exact.norm() < 1e-2
    assert ((got.double() - rounded).abs() <= 1e-5 * scale + 1e-30).all(), "x is not rounded to bf16 as in ggml"


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("T,A,E,N,K", SIZES)
def test_bf16_up_and_down_match_float64_within_bf16_rounding_of_x(use, T, A, E, N, K, threads) -> None:
    x, ids, wt, w = _case(T, A, E, N, K, torch.bfloat16)
    _assert_bf16_close(cpu_moe.moe_up(x, ids, w, threads), x, lambda v: _up64(v, ids, w),
                       lambda v: _up64(v, ids, w.abs()))
    h = torch.randn(T * A, K, generator=torch.Generator().manual_seed(7))
    _assert_bf16_close(cpu_moe.moe_down(h, ids, wt, w, threads), h, lambda v: _down64(v, ids, wt, w),
                       lambda v: _down64(v, ids, wt, w.abs()))


@pytest.mark.parametrize("T,A,E,N,K", SIZES)
def test_f32_up_and_down_match_float64(use, T, A, E, N, K) -> None:
    x, ids, wt, w = _case(T, A, E, N, K, torch.float32)
    assert torch.allclose(cpu_moe.moe_up(x, ids, w, 2).double(), _up64(x, ids, w), rtol=1e-5, atol=1e-5)
    h = torch.randn(T * A, K, generator=torch.Generator().manual_seed(7))
    assert torch.allclose(cpu_moe.moe_down(h, ids, wt, w, 2).double(), _down64(h, ids, wt, w), rtol=1e-5, atol=1e-5)


def test_bf16_kernel_uses_avx512_bf16_where_the_cpu_has_it() -> None:
    if "avx512_bf16" not in _cpu_flags():
        pytest.skip("this CPU has no AVX512-BF16: the portable loops are the right build")
    assert cpu_moe.bf16_kernel() == "avx512bf16"


def test_a_failed_compile_falls_back_to_the_next_flags(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("OFFLOAD_TUNER_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_moe, "BUILD_FLAGS", (("-O3", "--no-such-compiler-flag"), cpu_moe.BUILD_FLAGS[1]))
    cpu_moe._library.cache_clear()
    try:
        assert cpu_moe.bf16_kernel() == "portable"
        assert len(list(tmp_path.glob("cpu_moe-*.so"))) == 1
    finally:
        cpu_moe._library.cache_clear()
