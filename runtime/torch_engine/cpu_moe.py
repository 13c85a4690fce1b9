"""Routed experts on the CPU for decode-sized batches: one OpenMP pass over the chosen experts' rows.

PyTorch offers no GEMV over experts picked by index: one F.linear per expert matrix pays ~25 us of per-op
overhead on a ~3 MB matrix and reaches ~27% of the CPU's GEMV bandwidth (../shared/reference/gpu-box.md), and
gathering the experts (index_select + bmm) copies them. This small C kernel (compiled once per machine with the
system C compiler, -O3 -march=native -fopenmp, cached under ~/.cache/offload-tuner) reads each chosen expert's
rows in place, in the stacked [E, N, K] layout of ffn_*_exps, with all threads in one parallel loop:

    up:   y[t*A + a][n] = dot(W[ids[t, a]][n], x[t])                    (gate and up, packed as [E, 2F, D])
    down: out[t][n] = sum_a w[t, a] * dot(W[ids[t, a]][n], h[t*A + a])  (the weighted sum fused)

Weights bf16 or float32, activations float32. It links the OpenMP runtime PyTorch has loaded (same soname), so
no second thread pool competes with torch's. Without a C compiler `available()` is False and callers fall back
to per-expert F.linear.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

import torch

SOURCE = r"""
#include <stdint.h>
#include <string.h>

static inline float bf16f(uint16_t v) { union { uint32_t u; float f; } c; c.u = (uint32_t)v << 16; return c.f; }

#define DOT(NAME, WT, CONV)                                                                    \
static inline float NAME(const WT* w, const float* x, int64_t K) {                          \
    float acc = 0.0f;                                                                          \
    _Pragma("omp simd reduction(+:acc)")                                                       \
    for (int64_t k = 0; k < K; k++) acc += x[k] * CONV(w[k]);                                 \
    return acc;                                                                                \
}
#define ID(v) (v)
DOT(dot_bf16, uint16_t, bf16f)
DOT(dot_f32, float, ID)

#define KERNELS(SUF, WT, DOTF)                                                                 \
void moe_up_##SUF(const WT* W, int64_t ws, int64_t rs, const float* x, int64_t xs,           \
                  const int64_t* ids, int64_t T, int64_t A, int64_t N, int64_t K, float* y,    \
                  int threads) {                                                               \
    int64_t total = T * A * N;                                                                 \
    _Pragma("omp parallel for num_threads(threads) schedule(static)")                          \
    for (int64_t i = 0; i < total; i++) {                                                      \
        int64_t p = i / N, n = i % N;                                                          \
        y[i] = DOTF(W + ids[p] * ws + n * rs, x + (p / A) * xs, K);                           \
    }                                                                                          \
}                                                                                              \
void moe_down_##SUF(const WT* W, int64_t ws, int64_t rs, const float* h, int64_t hs,         \
                    const int64_t* ids, const float* wt, int64_t T, int64_t A, int64_t N,      \
                    int64_t K, float* out, int threads) {                                      \
    int64_t total = T * N;                                                                     \
    _Pragma("omp parallel for num_threads(threads) schedule(static)")                          \
    for (int64_t i = 0; i < total; i++) {                                                      \
        int64_t t = i / N, n = i % N;                                                          \
        float acc = 0.0f;                                                                      \
        for (int64_t a = 0; a < A; a++) {                                                      \
            int64_t p = t * A + a;                                                             \
            acc += wt[p] * DOTF(W + ids[p] * ws + n * rs, h + p * hs, K);                      \
        }                                                                                      \
        out[i] = acc;                                                                          \
    }                                                                                          \
}
KERNELS(bf16, uint16_t, dot_bf16)
KERNELS(f32, float, dot_f32)
"""

_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int


def _cache_dir() -> Path:
    return Path(os.environ.get("OFFLOAD_TUNER_CACHE", Path.home() / ".cache" / "offload-tuner"))


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        return None
    flags = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
    tag = hashlib.sha256((SOURCE + " ".join(flags) + cc).encode()).hexdigest()[:16]
    lib = _cache_dir() / f"cpu_moe-{tag}.so"
    try:
        if not lib.exists():
            lib.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
                src = Path(tmp) / "cpu_moe.c"
                src.write_text(SOURCE)
                out = Path(tmp) / lib.name
                subprocess.run([cc, *flags, str(src), "-o", str(out)], check=True, capture_output=True, timeout=120)
                os.replace(out, lib)
        dll = ctypes.CDLL(str(lib))
    except (OSError, subprocess.SubprocessError):
        return None
    for suffix in ("bf16", "f32"):
        getattr(dll, f"moe_up_{suffix}").argtypes = [_PTR, _I64, _I64, _PTR, _I64, _PTR, _I64, _I64, _I64, _I64,
                                                     _PTR, _INT]
        getattr(dll, f"moe_down_{suffix}").argtypes = [_PTR, _I64, _I64, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64,
                                                       _I64, _PTR, _INT]
    return dll


def available(dtype: torch.dtype) -> bool:
    return dtype in (torch.bfloat16, torch.float32) and _library() is not None


def _suffix(w: torch.Tensor) -> str:
    return "bf16" if w.dtype == torch.bfloat16 else "f32"


def _check(w: torch.Tensor) -> None:
    if w.device.type != "cpu" or w.stride(2) != 1:
        raise ValueError("cpu_moe needs a CPU [E, N, K] weight with unit stride along K")


def moe_up(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, threads: int) -> torch.Tensor:
    """x [T, K] -> [T*A, N] float32: x[t] @ w[ids[t, a]].T for w [E, N, K] (any row stride, unit K stride)."""
    _check(w)
    T, A = ids.shape
    E, N, K = w.shape
    xf = x.float().contiguous()
    ids = ids.contiguous()
    y = torch.empty(T * A, N, dtype=torch.float32)
    getattr(_library(), f"moe_up_{_suffix(w)}")(w.data_ptr(), w.stride(0), w.stride(1), xf.data_ptr(), xf.stride(0),
                                              ids.data_ptr(), T, A, N, K, y.data_ptr(), threads)
    return y


def moe_down(h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w: torch.Tensor, threads: int) -> torch.Tensor:
    """h [T*A, K] -> [T, N] float32: sum over a of weights[t, a] * h[t*A + a] @ w[ids[t, a]].T."""
    _check(w)
    T, A = ids.shape
    E, N, K = w.shape
    hf = h.float().contiguous()
    wt = weights.float().contiguous()
    ids = ids.contiguous()
    out = torch.empty(T, N, dtype=torch.float32)
    getattr(_library(), f"moe_down_{_suffix(w)}")(w.data_ptr(), w.stride(0), w.stride(1), hf.data_ptr(), hf.stride(0),
                                                ids.data_ptr(), wt.data_ptr(), T, A, N, K, out.data_ptr(), threads)
    return out
