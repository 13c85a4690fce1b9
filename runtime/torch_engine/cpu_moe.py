"""Routed experts on the CPU for decode-sized batches: one OpenMP pass over the chosen experts' rows.

PyTorch offers no GEMV over experts picked by index: one F.linear per expert matrix pays ~25 us of per-op
overhead on a ~3 MB matrix and reaches ~27% of the CPU's GEMV bandwidth (measured on the H100 box, 16 threads), and
gathering the experts (index_select + bmm) copies them. This small C kernel (compiled once per machine with the
system C compiler, -O3 -march=native -fopenmp, cached under ~/.cache/offload-tuner) reads each chosen expert's
rows in place, in the stacked [E, N, K] layout of ffn_*_exps, with all threads in one parallel loop:

    up:   y[t*A + a][n] = dot(W[ids[t, a]][n], x[t])                    (gate and up, packed as [E, 2F, D])
    down: out[t][n] = sum_a w[t, a] * dot(W[ids[t, a]][n], h[t*A + a])  (the weighted sum fused)

Weights bf16 or float32, activations given as float32. Each thread takes four rows at a time (four memory
streams, four independent accumulator chains) so that the loop keeps up with memory. With bf16 weights the
activations are rounded to bf16 once per token, as llama.cpp does (ggml-cpu: the BF16 type's vec_dot_type is
BF16), and where the compiler targets AVX512-BF16 the dot products run on VDPBF16PS; elsewhere portable
OpenMP-SIMD loops compute the same products (bf16 x bf16 is exact in fp32), summed in another order.
`bf16_kernel()` says which one was built. The build falls back through BUILD_FLAGS (the intrinsics off, then
no -march=native) where a compile fails. It links the OpenMP runtime PyTorch has loaded (same soname), so no
second thread pool competes with torch's. Without a C compiler `available()` is False and callers fall back to
per-expert F.linear.
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
from typing import Literal

import torch

from planner import children

SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && !defined(CPU_MOE_PORTABLE)
#include <immintrin.h>
#define BF16_DP 1
#endif

static inline float bf16f(uint16_t v) { union { uint32_t u; float f; } c; c.u = (uint32_t)v << 16; return c.f; }

/* float -> bf16, round to nearest even, NaN kept (quiet): ggml's GGML_FP32_TO_BF16, torch's .bfloat16() */
static inline uint16_t bf16r(float f) {
    union { uint32_t u; float f; } c; c.f = f;
    if ((c.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((c.u >> 16) | 64);
    return (uint16_t)((c.u + 0x7fffu + ((c.u >> 16) & 1u)) >> 16);
}

/* Activations for bf16 weights are rounded to bf16 once per token, on every path, as llama.cpp does:
   ggml-cpu's type_traits_cpu[GGML_TYPE_BF16].vec_dot_type is GGML_TYPE_BF16 (ggml/src/ggml-cpu/ggml-cpu.c),
   so ggml_vec_dot_bf16 multiplies bf16 weights by bf16 activations and accumulates in fp32. Our numerics match
   its; a bf16 x bf16 product is exact in fp32, so the paths below differ only in summation order (and in
   VDPBF16PS flushing denormals). */
#ifdef BF16_DP
typedef uint16_t xbf_t;                                  /* packed bf16, fed to VDPBF16PS */
static inline xbf_t xbf(float f) { return bf16r(f); }
#else
typedef float xbf_t;                                     /* fp32 holding the bf16-rounded value */
static inline xbf_t xbf(float f) { return bf16f(bf16r(f)); }
#endif
static inline float xf32(float f) { return f; }

/* Four rows against one activation row: four memory streams and four accumulator chains per thread, each
   activation load shared by the four. */
#define DOT4(NAME, WT, XT, CONV)                                                                \
static inline void NAME(const WT* const* w, const XT* x, int64_t K, float* d) {              \
    const WT *w0 = w[0], *w1 = w[1], *w2 = w[2], *w3 = w[3];                                  \
    float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;                                          \
    _Pragma("omp simd reduction(+:a0,a1,a2,a3)")                                               \
    for (int64_t k = 0; k < K; k++) {                                                          \
        float xk = x[k];                                                                       \
        a0 += xk * CONV(w0[k]); a1 += xk * CONV(w1[k]);                                        \
        a2 += xk * CONV(w2[k]); a3 += xk * CONV(w3[k]);                                        \
    }                                                                                          \
    d[0] = a0; d[1] = a1; d[2] = a2; d[3] = a3;                                                \
}
#define ID(v) (v)
DOT4(dot4_f32, float, float, ID)

#ifdef BF16_DP
/* 32 bf16 pairs per VDPBF16PS; the tail (K % 32) through zero-masked loads, which never touch masked bytes */
static inline void dot4_bf16(const uint16_t* const* w, const uint16_t* x, int64_t K, float* d) {
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
    const uint16_t *w0 = w[0], *w1 = w[1], *w2 = w[2], *w3 = w[3];
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        __m512bh xv = (__m512bh)_mm512_loadu_si512(x + k);
        a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(w0 + k), xv);
        a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(w1 + k), xv);
        a2 = _mm512_dpbf16_ps(a2, (__m512bh)_mm512_loadu_si512(w2 + k), xv);
        a3 = _mm512_dpbf16_ps(a3, (__m512bh)_mm512_loadu_si512(w3 + k), xv);
    }
    if (k < K) {
        __mmask32 m = (__mmask32)((1u << (K - k)) - 1u);
        __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(m, x + k);
        a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_maskz_loadu_epi16(m, w0 + k), xv);
        a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_maskz_loadu_epi16(m, w1 + k), xv);
        a2 = _mm512_dpbf16_ps(a2, (__m512bh)_mm512_maskz_loadu_epi16(m, w2 + k), xv);
        a3 = _mm512_dpbf16_ps(a3, (__m512bh)_mm512_maskz_loadu_epi16(m, w3 + k), xv);
    }
    d[0] = _mm512_reduce_add_ps(a0); d[1] = _mm512_reduce_add_ps(a1);
    d[2] = _mm512_reduce_add_ps(a2); d[3] = _mm512_reduce_add_ps(a3);
}
int cpu_moe_bf16_dp(void) { return 1; }
#else
DOT4(dot4_bf16, uint16_t, float, bf16f)
int cpu_moe_bf16_dp(void) { return 0; }
#endif

/* The four rows j + r*Q (r < 4, Q = ceil(N/4)) of one expert: a quarter of the matrix apart, so that a thread
   walking j reads four long sequential streams (four adjacent rows are four short streams, each a row long: on
   a 2-core Zen4 they ran at ~55-80% of the spaced ones for rows of 2-4 KiB). Past N row j again (read, never
   stored). */
#define ROWS4(w, base, j, Q, N, rs) \
    for (int r = 0; r < 4; r++) w[r] = (base) + ((j) + r * (Q) < (N) ? (j) + r * (Q) : (j)) * (rs)

/* Each activation row is converted (or copied) once into a packed [rows, K] buffer in the same parallel region.
   Returns 1 where that buffer cannot be allocated. */
#define KERNELS(SUF, WT, XT, XCONV, DOT4F)                                                     \
int moe_up_##SUF(const WT* W, int64_t ws, int64_t rs, const float* x, int64_t xs,            \
                 const int64_t* ids, int64_t T, int64_t A, int64_t N, int64_t K, float* y,     \
                 int threads) {                                                                \
    XT* xb = (XT*)malloc((size_t)(T * K > 0 ? T * K : 1) * sizeof(XT));                        \
    if (!xb) return 1;                                                                         \
    int64_t Q = (N + 3) / 4, total = T * A * Q;                                              \
    _Pragma("omp parallel num_threads(threads)")                                               \
    {                                                                                          \
        _Pragma("omp for collapse(2) schedule(static)")                                        \
        for (int64_t t = 0; t < T; t++)                                                        \
            for (int64_t k = 0; k < K; k++) xb[t * K + k] = XCONV(x[t * xs + k]);             \
        _Pragma("omp for schedule(static)")                                                    \
        for (int64_t i = 0; i < total; i++) {                                                  \
            int64_t p = i / Q, j = i % Q;                                                      \
            const WT* w[4];                                                                    \
            ROWS4(w, W + ids[p] * ws, j, Q, N, rs);                                            \
            float d[4];                                                                        \
            DOT4F(w, xb + (p / A) * K, K, d);                                                  \
            for (int r = 0; r < 4 && j + r * Q < N; r++) y[p * N + j + r * Q] = d[r];          \
        }                                                                                      \
    }                                                                                          \
    free(xb);                                                                                  \
    return 0;                                                                                  \
}                                                                                              \
int moe_down_##SUF(const WT* W, int64_t ws, int64_t rs, const float* h, int64_t hs,          \
                   const int64_t* ids, const float* wt, int64_t T, int64_t A, int64_t N,       \
                   int64_t K, float* out, int threads) {                                       \
    int64_t P = T * A;                                                                         \
    XT* hb = (XT*)malloc((size_t)(P * K > 0 ? P * K : 1) * sizeof(XT));                        \
    if (!hb) return 1;                                                                         \
    int64_t Q = (N + 3) / 4, total = T * Q;                                                  \
    _Pragma("omp parallel num_threads(threads)")                                               \
    {                                                                                          \
        _Pragma("omp for collapse(2) schedule(static)")                                        \
        for (int64_t p = 0; p < P; p++)                                                        \
            for (int64_t k = 0; k < K; k++) hb[p * K + k] = XCONV(h[p * hs + k]);             \
        _Pragma("omp for schedule(static)")                                                    \
        for (int64_t i = 0; i < total; i++) {                                                  \
            int64_t t = i / Q, j = i % Q;                                                      \
            float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};                                           \
            for (int64_t a = 0; a < A; a++) {                                                  \
                int64_t p = t * A + a;                                                         \
                const WT* w[4];                                                                \
                ROWS4(w, W + ids[p] * ws, j, Q, N, rs);                                        \
                float d[4];                                                                    \
                DOT4F(w, hb + p * K, K, d);                                                    \
                for (int r = 0; r < 4; r++) acc[r] += wt[p] * d[r];                            \
            }                                                                                  \
            for (int r = 0; r < 4 && j + r * Q < N; r++) out[t * N + j + r * Q] = acc[r];      \
        }                                                                                      \
    }                                                                                          \
    free(hb);                                                                                  \
    return 0;                                                                                  \
}
KERNELS(bf16, uint16_t, xbf_t, xbf, dot4_bf16)
KERNELS(f32, float, float, xf32, dot4_f32)
"""

_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
BF16Kernel = Literal["avx512bf16", "portable"]

# Compiler flags, tried in order until one builds (each build cached under its own hash): -march=native selects
# VDPBF16PS where the CPU has AVX512-BF16; the second keeps -march=native but the portable loops (a compiler
# without those intrinsics); the last is for a compiler that does not know -march=native.
BUILD_FLAGS: tuple[tuple[str, ...], ...] = (
    ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"),
    ("-O3", "-march=native", "-DCPU_MOE_PORTABLE", "-fopenmp", "-shared", "-fPIC"),
    ("-O3", "-fopenmp", "-shared", "-fPIC"),
)


def _cache_dir() -> Path:
    return Path(os.environ.get("OFFLOAD_TUNER_CACHE", Path.home() / ".cache" / "offload-tuner"))


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def _build(cc: str, flags: tuple[str, ...]) -> ctypes.CDLL | None:
    """SOURCE compiled with these flags (or the cached build), loaded; None where it does not compile or load."""
    tag = hashlib.sha256((SOURCE + " ".join(flags) + cc).encode()).hexdigest()[:16]
    lib = _cache_dir() / f"cpu_moe-{tag}.so"
    try:
        if not lib.exists():
            lib.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
                src = Path(tmp) / "cpu_moe.c"
                src.write_text(SOURCE)
                out = Path(tmp) / lib.name
                children.run([cc, *flags, str(src), "-o", str(out)], check=True, capture_output=True, timeout=120)
                os.replace(out, lib)
        dll = ctypes.CDLL(str(lib))
    except (OSError, subprocess.SubprocessError):
        return None
    for suffix in ("bf16", "f32"):
        up, down = getattr(dll, f"moe_up_{suffix}"), getattr(dll, f"moe_down_{suffix}")
        up.argtypes = [_PTR, _I64, _I64, _PTR, _I64, _PTR, _I64, _I64, _I64, _I64, _PTR, _INT]
        down.argtypes = [_PTR, _I64, _I64, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _I64, _PTR, _INT]
        up.restype = down.restype = _INT
    dll.cpu_moe_bf16_dp.argtypes = []
    dll.cpu_moe_bf16_dp.restype = _INT
    return dll


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    cc = _compiler()
    if cc is None:
        return None
    for flags in BUILD_FLAGS:
        dll = _build(cc, flags)
        if dll is not None:
            return dll
    return None


def bf16_kernel() -> BF16Kernel | None:
    """The bf16 dot product compiled here: "avx512bf16" (VDPBF16PS), "portable" (fp32 loops), None (no kernel)."""
    dll = _library()
    if dll is None:
        return None
    return "avx512bf16" if dll.cpu_moe_bf16_dp() else "portable"


def available(dtype: torch.dtype) -> bool:
    return dtype in (torch.bfloat16, torch.float32) and _library() is not None


def _suffix(w: torch.Tensor) -> str:
    return "bf16" if w.dtype == torch.bfloat16 else "f32"


def _check(w: torch.Tensor) -> None:
    if w.device.type != "cpu" or w.stride(2) != 1:
        raise ValueError("cpu_moe needs a CPU [E, N, K] weight with unit stride along K")


def _raise_on(rc: int, n_values: int) -> None:
    if rc != 0:
        raise MemoryError(f"cpu_moe could not allocate its activation buffer ({n_values} values)")


def moe_up(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, threads: int) -> torch.Tensor:
    """x [T, K] -> [T*A, N] float32: x[t] @ w[ids[t, a]].T for w [E, N, K] (any row stride, unit K stride)."""
    _check(w)
    T, A = ids.shape
    E, N, K = w.shape
    xf = x.float().contiguous()
    ids = ids.contiguous()
    y = torch.empty(T * A, N, dtype=torch.float32)
    rc = getattr(_library(), f"moe_up_{_suffix(w)}")(w.data_ptr(), w.stride(0), w.stride(1), xf.data_ptr(),
                                                   xf.stride(0), ids.data_ptr(), T, A, N, K, y.data_ptr(), threads)
    _raise_on(rc, T * K)
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
    rc = getattr(_library(), f"moe_down_{_suffix(w)}")(w.data_ptr(), w.stride(0), w.stride(1), hf.data_ptr(),
                                                     hf.stride(0), ids.data_ptr(), wt.data_ptr(), T, A, N, K,
                                                     out.data_ptr(), threads)
    _raise_on(rc, T * A * K)
    return out
