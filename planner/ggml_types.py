"""ggml tensor types: id -> (name, elements per block, bytes per block, extra bytes per row).

Sources: ggml/include/ggml.h and ggml/src/ggml-common.h (block structs) of mainline llama.cpp (the version
vendored in llama-cpp-python 0.3.36) for ids 0-42 (gguf-py's GGML_QUANT_SIZES agrees but for Q8_1, where it
still says 40 bytes: block_q8_1 is two fp16 + 32 int8 = 36); ik_llama.cpp ggml/include/ggml.h for ids >= 133
(row metadata: ik stores a per-row scale in front of each row of the *_KS / *_KT / *_KL types;
docs/llamacpp.md, section 9). Repacked ik types (_R4/_R8, ids 202-399) keep their base type's
size per element; their id ranges are listed but not sized: the header reader then takes their size from data
offsets.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GGMLType:
    id: int
    name: str
    block: int          # elements per block
    block_bytes: int    # bytes per block
    row_meta_bytes: int = 0  # ik: bytes in front of every row

    def row_bytes(self, n: int) -> int:
        """Bytes of one row of n elements (n must be a multiple of the block size)."""
        return n // self.block * self.block_bytes + self.row_meta_bytes

    def nbytes(self, shape: tuple[int, ...]) -> int:
        rows = 1
        for d in shape[1:]:
            rows *= d
        return self.row_bytes(shape[0]) * rows


_TABLE = [
    # mainline (ggml.h enum ggml_type)
    (0, "F32", 1, 4), (1, "F16", 1, 2), (2, "Q4_0", 32, 18), (3, "Q4_1", 32, 20), (6, "Q5_0", 32, 22),
    (7, "Q5_1", 32, 24), (8, "Q8_0", 32, 34), (9, "Q8_1", 32, 36), (10, "Q2_K", 256, 84),
    (11, "Q3_K", 256, 110), (12, "Q4_K", 256, 144), (13, "Q5_K", 256, 176), (14, "Q6_K", 256, 210),
    (15, "Q8_K", 256, 292), (16, "IQ2_XXS", 256, 66), (17, "IQ2_XS", 256, 74), (18, "IQ3_XXS", 256, 98),
    (19, "IQ1_S", 256, 50), (20, "IQ4_NL", 32, 18), (21, "IQ3_S", 256, 110), (22, "IQ2_S", 256, 82),
    (23, "IQ4_XS", 256, 136), (24, "I8", 1, 1), (25, "I16", 1, 2), (26, "I32", 1, 4), (27, "I64", 1, 8),
    (28, "F64", 1, 8), (29, "IQ1_M", 256, 56), (30, "BF16", 1, 2), (34, "TQ1_0", 256, 54),
    (35, "TQ2_0", 256, 66), (39, "MXFP4", 32, 17), (40, "NVFP4", 64, 36), (41, "Q1_0", 128, 18),
    (42, "Q2_0", 64, 18),
    # ik_llama.cpp additions (ids >= 133)
    (133, "Q6_0", 32, 26), (137, "IQ2_K", 256, 76), (138, "IQ3_K", 256, 110), (139, "IQ4_K", 256, 144),
    (140, "IQ5_K", 256, 176), (141, "IQ6_K", 256, 212),
    (144, "IQ4_KS", 256, 136, 4), (145, "IQ2_KS", 256, 70, 2), (146, "IQ4_KSS", 256, 128, 4),
    (152, "IQ5_KS", 256, 168, 4), (153, "IQ2_KT", 256, 68, 4), (154, "IQ3_KT", 256, 100, 4),
    (155, "IQ4_KT", 256, 128, 4), (156, "IQ3_KS", 256, 102, 2), (157, "IQ2_KL", 256, 86, 2),
]

BY_ID: dict[int, GGMLType] = {row[0]: GGMLType(*row) for row in _TABLE}
BY_NAME: dict[str, GGMLType] = {t.name: t for t in BY_ID.values()}
# ik's row-interleaved repacked types: known to exist, sized from file offsets only.
IK_REPACKED_IDS = range(202, 400)


def by_name(name: str) -> GGMLType:
    from .errors import InputError
    try:
        return BY_NAME[name.upper()]
    except KeyError:
        raise InputError(f"unknown ggml type {name!r}; known: {', '.join(sorted(BY_NAME))}") from None


def type_name(type_id: int) -> str:
    t = BY_ID.get(type_id)
    if t is not None:
        return t.name
    if type_id in IK_REPACKED_IDS:
        return f"IK_R{type_id}"
    return f"TYPE_{type_id}"


# Quantization fallback when a row length (ne0) is not a multiple of the type's block: llama.cpp
# src/llama-quant.cpp tensor_type_fallback(); a fallback that still does not fit becomes F16.
FALLBACK: dict[str, str] = {
    **{t: "IQ4_NL" for t in ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_XS")},
    **{t: "Q4_0" for t in ("Q2_0", "Q2_K", "Q3_K", "TQ1_0", "TQ2_0")},
    "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0",
}


def fit_type(name: str, ne0: int) -> str:
    """The type llama-quantize actually writes for a row of ne0 elements when asked for `name`."""
    t = by_name(name)
    if ne0 % t.block == 0:
        return t.name
    fb = FALLBACK.get(t.name, t.name)
    return fb if ne0 % by_name(fb).block == 0 else "F16"
