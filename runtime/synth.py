"""Synthetic GGUF files that llama.cpp loads: any arch we model, any size, random weights, no download.

A file holds the metadata of archs.metadata_for(spec) and the tensors of archs.tensor_shapes(spec), so its
inventory equals archs.build_inventory(spec, type_of). Weights are random but sane: quantized blocks are random
bytes whose scale fields are patched to small finite values (BLOCK_SCALES), floats are small normals, norms are
~1 and biases 0. Data is streamed tensor by tensor from a few-MB pool of random blocks reused at random offsets,
so a 17 GB file writes at disk speed; `sparse=True` writes only the headers and truncates each file to its full
size (for header tools and tests). `split_max_bytes` writes shards the way llama.cpp's gguf-split does.
"""
from __future__ import annotations

import os
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO
from collections.abc import Callable, Iterable

import numpy as np

from planner.archs import ARCH_FEATURES, SWA_PATTERN, ArchSpec, metadata_for, require_arch, tensor_shapes
from planner.errors import InputError
from planner.ggml_types import BY_NAME, by_name, fit_type
from planner.model import Hparams, classify

TypeOf = Callable[[str, tuple[int, ...], "int | None"], str]
Progress = Callable[[int], None]

ALIGNMENT = 32
GGUF_VERSION = 3
POOL_BYTES = 4 << 20          # random data reused across a tensor at random block offsets


# ---- random block contents --------------------------------------------------------------------------------

@dataclass(frozen=True)
class BlockScales:
    """Where a block keeps its scales, and values that give weights of std ~0.02 (as an initialised model)."""
    f16: tuple[tuple[int, float], ...] = ()   # (byte offset of an fp16 field, its value; min fields negative)
    e8m0: tuple[tuple[int, int], ...] = ()    # (byte offset of an E8M0 exponent byte, its value)


# Block layouts from ggml/src/ggml-common.h (block_q4_0 ... block_mxfp4); values from each type's dequantize
# formula, e.g. Q4_0 w = d * (q - 8) with q uniform in 0..15 (std 4.6) -> d = 0.02 / 4.6. K-quants' dmin is
# set so the block mean is near 0. MXFP4: w = 2^(e - 128) * kvalue (kvalues up to 12), e = 120 -> std ~0.02.
BLOCK_SCALES: dict[str, BlockScales] = {
    "Q4_0": BlockScales(f16=((0, 4.3e-3),)),
    "Q4_1": BlockScales(f16=((0, 4.3e-3), (2, -3.2e-2))),
    "Q5_0": BlockScales(f16=((0, 2.2e-3),)),
    "Q5_1": BlockScales(f16=((0, 2.2e-3), (2, -3.4e-2))),
    "Q8_0": BlockScales(f16=((0, 2.7e-4),)),
    "Q2_K": BlockScales(f16=((80, 2.0e-3), (82, 3.0e-3))),
    "Q3_K": BlockScales(f16=((108, 5.0e-4),)),
    "Q4_K": BlockScales(f16=((0, 1.2e-4), (2, 9.0e-4))),
    "Q5_K": BlockScales(f16=((0, 6.0e-5), (2, 9.3e-4))),
    "Q6_K": BlockScales(f16=((208, 1.5e-5),)),
    "IQ4_NL": BlockScales(f16=((0, 3.3e-4),)),
    "IQ4_XS": BlockScales(f16=((0, 2.0e-5),)),
    "MXFP4": BlockScales(e8m0=((0, 120),)),
}
FLOAT_TYPES: dict[str, np.dtype] = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2")}
WRITABLE_TYPES = tuple(FLOAT_TYPES) + tuple(BLOCK_SCALES)
WEIGHT_STD = 0.02


def _floats(values: np.ndarray, ggml_type: str) -> bytes:
    if ggml_type == "BF16":   # the upper half of an fp32 (truncation is fine for random data)
        return (values.astype("<f4").view("<u4") >> 16).astype("<u2").tobytes()
    return values.astype(FLOAT_TYPES[ggml_type]).tobytes()


class _RandomData:
    """Per-type pools of random blocks for one write; each tensor reads its pool from a random block on."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.pools: dict[str, memoryview] = {}

    def pool(self, ggml_type: str) -> memoryview:
        if ggml_type not in self.pools:
            self.pools[ggml_type] = memoryview(self._make(ggml_type))
        return self.pools[ggml_type]

    def _make(self, ggml_type: str) -> bytes:
        if ggml_type in FLOAT_TYPES:
            n = POOL_BYTES // FLOAT_TYPES[ggml_type].itemsize
            return _floats(self.rng.normal(0.0, WEIGHT_STD, n).astype(np.float32), ggml_type)
        t, layout = BY_NAME[ggml_type], BLOCK_SCALES[ggml_type]
        blocks = self.rng.integers(0, 256, size=(POOL_BYTES // t.block_bytes, t.block_bytes), dtype=np.uint8)
        for offset, value in layout.f16:
            scale = (value * self.rng.uniform(0.5, 1.5, len(blocks))).astype("<f2")
            blocks[:, offset:offset + 2] = scale.view(np.uint8).reshape(-1, 2)
        for offset, exponent in layout.e8m0:
            blocks[:, offset] = exponent + self.rng.integers(-1, 2, len(blocks))
        return blocks.tobytes()

    def write(self, out: BinaryIO, name: str, shape: tuple[int, ...], ggml_type: str, nbytes: int) -> None:
        if name.endswith(".bias"):
            _write_zeros(out, nbytes)          # biases 0: the model starts as a plain (bias-free) one
        elif len(shape) == 1 and ggml_type in FLOAT_TYPES:
            # norms ~1 (a norm of 0 would silence the layer), other vectors (sinks) small
            base = 1.0 if "norm" in name else 0.0
            out.write(_floats(base + self.rng.normal(0.0, WEIGHT_STD, shape[0]).astype(np.float32), ggml_type))
        else:
            pool, unit = self.pool(ggml_type), BY_NAME[ggml_type].block_bytes   # F32: 4 bytes, Q8_0: 34 ...
            pos = int(self.rng.integers(len(pool) // unit)) * unit
            left = nbytes
            while left:
                n = min(len(pool) - pos, left)
                out.write(pool[pos:pos + n])
                left -= n
                pos = 0


def _write_zeros(out: BinaryIO, n: int) -> None:
    zeros = memoryview(bytes(min(n, POOL_BYTES)))
    while n:
        k = min(n, len(zeros))
        out.write(zeros[:k])
        n -= k


# ---- GGUF encoding (format: docs/llamacpp.md section 9; ggml/src/gguf.cpp) --------------------

# GGUF value type ids (gguf.cpp enum gguf_type) and how we pack them.
_U16, _I32, _U32, _F32, _BOOL, _STR, _ARR, _U64, _I64 = 2, 5, 4, 6, 7, 8, 9, 10, 11
_PACK = {_U16: "<H", _I32: "<i", _U32: "<I", _F32: "<f", _BOOL: "<?", _U64: "<Q", _I64: "<q"}
# Keys whose type llama.cpp checks as gguf-split writes them (tools/gguf-split/gguf-split.cpp).
KEY_TYPES = {"split.no": _U16, "split.count": _U16, "split.tensors.count": _I32}


def _gguf_str(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def _value_type(value: Any) -> int:
    if isinstance(value, bool):
        return _BOOL
    if isinstance(value, int):
        return _U32 if 0 <= value < 1 << 32 else _I64
    if isinstance(value, float):
        return _F32
    if isinstance(value, str):
        return _STR
    if isinstance(value, (list, tuple)):
        return _ARR
    raise TypeError(f"cannot store {type(value).__name__} in GGUF metadata")


def _encode_value(vtype: int, value: Any) -> bytes:
    if vtype == _STR:
        return _gguf_str(value)
    if vtype == _ARR:
        etype = _value_type(value[0]) if value else _I32
        etype = _I32 if etype == _U32 else etype    # convert_hf_to_gguf writes int arrays as INT32
        return struct.pack("<IQ", etype, len(value)) + b"".join(_encode_value(etype, v) for v in value)
    return struct.pack(_PACK[vtype], value)


def encode_kv(key: str, value: Any) -> bytes:
    vtype = KEY_TYPES.get(key) or _value_type(value)
    return _gguf_str(key) + struct.pack("<I", vtype) + _encode_value(vtype, value)


def encode_tensor_info(name: str, shape: tuple[int, ...], type_id: int, offset: int) -> bytes:
    return _gguf_str(name) + struct.pack(f"<I{len(shape)}QIQ", len(shape), *shape, type_id, offset)


def encode_header(metadata: dict[str, Any], infos: Iterable[tuple[str, tuple[int, ...], int, int]],
                  alignment: int = ALIGNMENT) -> bytes:
    """Magic, version, counts, key-values, tensor infos and the padding up to the data section."""
    infos = list(infos)
    out = b"GGUF" + struct.pack("<IQQ", GGUF_VERSION, len(infos), len(metadata))
    out += b"".join(encode_kv(k, v) for k, v in metadata.items())
    out += b"".join(encode_tensor_info(*info) for info in infos)
    return out + bytes(-len(out) % alignment)


# ---- the writer ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Planned:
    name: str
    shape: tuple[int, ...]
    ggml_type: str
    nbytes: int

    @property
    def padded(self) -> int:
        return self.nbytes + (-self.nbytes % ALIGNMENT)


def _plan(spec: ArchSpec, type_of: TypeOf, tied_output: bool) -> list[_Planned]:
    out = []
    for name, shape in tensor_shapes(spec, tied_output):
        ggml_type = type_of(name, shape, classify(name)[0])
        if ggml_type not in WRITABLE_TYPES:
            raise InputError(f"synth cannot write {name} as {ggml_type}; it writes {', '.join(WRITABLE_TYPES)}")
        t = by_name(ggml_type)
        if shape[0] % t.block:
            raise InputError(f"{name}: row of {shape[0]} elements does not fit {ggml_type}'s block of {t.block}; "
                             f"use planner.ggml_types.fit_type (uniform_recipe does)")
        out.append(_Planned(name, shape, ggml_type, t.nbytes(shape)))
    return out


def _shards(tensors: list[_Planned], max_bytes: int | None) -> list[list[_Planned]]:
    """Group tensors in order; a new shard starts when the next tensor would pass max_bytes (gguf-split's
    should_split; a tensor larger than max_bytes gets a shard of its own)."""
    if max_bytes is None:
        return [tensors]
    shards: list[list[_Planned]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.padded > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.padded
    return shards


def shard_path(path: Path, index: int, count: int) -> Path:
    """llama.cpp's llama_split_path: PREFIX-%05d-of-%05d.gguf (index 0-based)."""
    prefix = path.name[:-5] if path.name.endswith(".gguf") else path.name
    return path.with_name(f"{prefix}-{index + 1:05d}-of-{count:05d}.gguf")


# SentencePiece token types (llama.h enum llama_token_type): what an SPM vocabulary marks its tokens as
_TOKEN_NORMAL, _TOKEN_UNKNOWN, _TOKEN_CONTROL, _TOKEN_BYTE = 1, 2, 3, 6


def spm_vocab(n_vocab: int) -> dict[str, Any]:
    """Metadata of a made-up SentencePiece vocabulary of n_vocab tokens, laid out as llama's: <unk>, <s>, </s>, the
    256 byte tokens <0x00>..<0xFF>, then "▁t<i>" pieces. Enough for a program that turns generated ids into text
    (llama-server streams each token's piece; with no vocabulary, llama-vocab.cpp has no pieces to give)."""
    if n_vocab < 259:
        raise InputError(f"an SPM vocabulary needs at least 259 tokens (3 special, 256 bytes); the model has {n_vocab}")
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    tokens += [f"\u2581t{i}" for i in range(n_vocab - len(tokens))]
    types = [_TOKEN_UNKNOWN, _TOKEN_CONTROL, _TOKEN_CONTROL] + [_TOKEN_BYTE] * 256
    types += [_TOKEN_NORMAL] * (n_vocab - len(types))
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": [-float(i) for i in range(n_vocab)], "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2}


def write_gguf(path: str | Path, spec: ArchSpec, type_of: TypeOf, *, tied_output: bool = False,
               sparse: bool = False, seed: int = 0, split_max_bytes: int | None = None,
               name: str = "synthetic", progress: Progress | None = None, vocab: bool = False) -> list[Path]:
    """Write a synthetic model; returns the files written (one, or the shards in order).

    progress, if given, is called with the number of data bytes after each tensor. vocab: a made-up SentencePiece
    vocabulary (spm_vocab) instead of none, for programs that print tokens as text (llama-server).
    """
    path = Path(path)
    tensors = _plan(spec, type_of, tied_output)
    groups = _shards(tensors, split_max_bytes)
    if len(groups) > 99999:
        raise InputError(f"--split-max {split_max_bytes} would make {len(groups)} shards; llama.cpp names allow 99999")
    arch = spec.hparams.arch
    model_meta: dict[str, Any] = {
        "general.architecture": arch, "general.name": name, "general.alignment": ALIGNMENT,
        **metadata_for(spec),
        # llama-vocab.cpp: "none" is no vocab, {arch}.vocab_size dummy tokens without text
        **(spm_vocab(spec.hparams.n_vocab) if vocab else {"tokenizer.ggml.model": "none"}),
    }
    data = _RandomData(seed)
    written = []
    for i, group in enumerate(groups):
        meta = model_meta if i == 0 else {}
        if split_max_bytes is not None:
            meta = {**meta, "split.no": i, "split.count": len(groups), "split.tensors.count": len(tensors)}
        out_path = shard_path(path, i, len(groups)) if split_max_bytes is not None else path
        _write_file(out_path, meta, group, data, sparse, progress)
        written.append(out_path)
    return written


def _write_file(path: Path, meta: dict[str, Any], tensors: list[_Planned], data: _RandomData, sparse: bool,
                progress: Progress | None) -> None:
    offsets, offset = [], 0
    for t in tensors:
        offsets.append(offset)
        offset += t.padded
    header = encode_header(meta, ((t.name, t.shape, BY_NAME[t.ggml_type].id, o) for t, o in zip(tensors, offsets)))
    with open(path, "wb") as out:             # buffered: write() always takes every byte
        out.write(header)
        if sparse:
            out.truncate(len(header) + offset)
            if progress:
                progress(offset)
            return
        for t in tensors:
            data.write(out, t.name, t.shape, t.ggml_type, t.nbytes)
            out.write(bytes(t.padded - t.nbytes))
            if progress:
                progress(t.padded)


# ---- recipes and tiny models --------------------------------------------------------------------------------

def uniform_recipe(default_type: str, expert_type: str | None = None) -> TypeOf:
    """type_of: 1-D tensors, routers and biases F32 (as llama-quantize keeps them); routed experts
    `expert_type` if given; everything else `default_type`, or llama-quantize's fallback where a row does not
    divide into its blocks (ggml_types.fit_type)."""
    by_name(default_type)
    if expert_type is not None:
        by_name(expert_type)

    def type_of(name: str, shape: tuple[int, ...], layer: int | None) -> str:
        if len(shape) == 1 or ".ffn_gate_inp." in name or name.endswith(".bias"):
            return "F32"
        if expert_type is not None and "_exps." in name:
            return fit_type(expert_type, shape[0])
        return fit_type(default_type, shape[0])
    return type_of


# Small but complete hparams per arch: a few MB per model. Every row (ne0) is 256 so K-quants fit, except
# deepseek2's attn_k_b (ne0 = qk_nope = 64), which fit_type turns into a 32-block type as llama-quantize would.
_TINY_BASE: dict[str, Any] = dict(
    n_layer=2, n_embd=256, n_vocab=512, n_head=4, n_head_kv=2, head_dim_k=64, head_dim_v=64, n_rot=64,
    n_ctx_train=4096, n_ff=512, n_expert=0, n_expert_used=0, n_ff_exp=0, n_expert_shared=0, n_ff_shexp=0,
    n_nextn=0, dense_lead=0, moe_step=1, n_swa=0, q_lora_rank=0, kv_lora_rank=0, head_dim_k_mla=0,
    head_dim_v_mla=0, features=(),
)
_MOE = dict(n_expert=8, n_expert_used=2, n_ff_exp=256)
TINY: dict[str, dict[str, Any]] = {
    "llama": {},
    "qwen3moe": dict(_MOE),
    "qwen2moe": dict(_MOE, n_expert_shared=1, n_ff_shexp=512),
    # MLA as DeepSeek-V3 converts: K = kv_lora + rope, V = kv_lora, one KV head; a dense leading layer
    "deepseek2": dict(_MOE, n_layer=3, dense_lead=1, n_expert_shared=1, n_head_kv=1, head_dim_k=288,
                      head_dim_v=256, n_rot=32, q_lora_rank=256, kv_lora_rank=256, head_dim_k_mla=96,
                      head_dim_v_mla=64, features=("probs_b",)),
    "gpt-oss": dict(_MOE, n_swa=128),
    "glm4moe": dict(_MOE, n_layer=3, dense_lead=1, n_nextn=1, n_expert_shared=1, features=("probs_b",)),
    "llama4": dict(n_expert=4, n_expert_used=1, n_ff_exp=256, n_layer=4, moe_step=2, n_swa=8192),
}


def tiny_spec(arch: str, **overrides: Any) -> ArchSpec:
    """A small ArchSpec of `arch` (keys of _TINY_BASE override it), consistent with what
    archs.spec_from_metadata reads back from the metadata of a file written from it."""
    if arch not in TINY:
        raise InputError(f"no tiny model for {arch!r}; known: {', '.join(TINY)}")
    unknown = set(overrides) - set(_TINY_BASE)
    if unknown:
        raise InputError(f"unknown tiny_spec keys {sorted(unknown)}; known: {', '.join(_TINY_BASE)}")
    p = {**_TINY_BASE, **TINY[arch], **overrides}
    n, n_main = p["n_layer"], p["n_layer"] - p["n_nextn"]
    if arch == "llama4":
        moe = tuple(p["n_expert"] > 0 and (i + 1) % p["moe_step"] == 0 for i in range(n))
    else:
        moe = tuple(p["n_expert"] > 0 and i >= p["dense_lead"] for i in range(n))
    period = SWA_PATTERN.get(arch, 0)
    swa = tuple(bool(period and p["n_swa"]) and i < n_main and i % period < period - 1 for i in range(n))
    n_shared, n_ff_shexp = p["n_expert_shared"], p["n_ff_shexp"]
    if arch in ("deepseek2", "glm4moe"):
        n_ff_shexp = p["n_ff_exp"] * n_shared          # as spec_from_metadata derives it
    elif arch == "llama4" and p["n_expert"]:
        n_shared, n_ff_shexp = 1, p["n_ff_exp"]
    hp = Hparams(
        arch=arch, n_layer=n, n_embd=p["n_embd"], n_vocab=p["n_vocab"], n_head=p["n_head"],
        n_head_kv=(p["n_head_kv"],) * n, head_dim_k=p["head_dim_k"], head_dim_v=p["head_dim_v"],
        n_ctx_train=p["n_ctx_train"], n_ff=p["n_ff"], n_expert=p["n_expert"], n_expert_used=p["n_expert_used"],
        n_ff_exp=p["n_ff_exp"], n_expert_shared=n_shared, n_ff_shexp=n_ff_shexp, moe_layers=moe,
        swa_layers=swa, n_swa=p["n_swa"] if any(swa) else 0, mla_kv_lora_rank=p["kv_lora_rank"],
        n_rot=p["n_rot"], n_nextn=p["n_nextn"],
    )
    return ArchSpec(hp, ARCH_FEATURES[arch] | frozenset(p["features"]), q_lora_rank=p["q_lora_rank"],
                    head_dim_k_mla=p["head_dim_k_mla"], head_dim_v_mla=p["head_dim_v_mla"])


# ---- `offload-tuner synth` ------------------------------------------------------------------------------

def tiny_archs() -> tuple[str, ...]:
    """The archs --tiny writes (the CLI's help names them)."""
    return tuple(TINY)


def _model_from(preset: str | None, arch: str | None, tiny: bool, quant: str | None,
                tied_output: bool) -> tuple[ArchSpec, TypeOf, str, bool]:
    """(spec, type_of, name, tied_output) for --preset NAME[:QUANT] or --arch ARCH --tiny [--quant T]."""
    if preset and arch:
        raise InputError("give either --preset NAME[:QUANT] or --arch ARCH --tiny, not both")
    if preset:
        if quant:
            raise InputError("--quant is for --tiny models; a preset takes its quant as --preset NAME:QUANT")
        from planner.presets import load_preset
        p = load_preset(preset)
        return p.spec, p.type_of, p.name, tied_output or p.tied_output
    if not arch or not tiny:
        raise InputError("synth needs --preset NAME[:QUANT], or --arch ARCH --tiny for a small test model")
    require_arch(arch)
    quant = quant or "Q8_0"
    return tiny_spec(arch), uniform_recipe(quant), f"tiny-{arch}-{quant}", tied_output


def synth(out: str, *, preset: str | None = None, arch: str | None = None, tiny: bool = False,
          quant: str | None = None, sparse: bool = False, split_max: str | None = None, seed: int = 0,
          tied_output: bool = False, progress_bar: bool = True) -> list[Path]:
    """Write the model a preset (NAME[:QUANT]) or a tiny ARCH [QUANT] describes to OUT (`offload-tuner synth`):
    the files written. A tqdm bar on stderr counts the bytes (progress_bar, a full write, stderr a TTY).
    InputError on bad arguments."""
    spec, type_of, name, tied = _model_from(preset, arch, tiny, quant, tied_output)
    if not 0 <= seed <= 2**32 - 1:         # numpy's seed range (else its ValueError, a traceback)
        raise InputError(f"--seed {str(seed)[:40]}: give 0 to {2**32 - 1}")
    split_max_bytes = None
    if split_max is not None:
        from planner.hardware import parse_size
        split_max_bytes = parse_size(split_max)
    total = sum(t.padded for t in _plan(spec, type_of, tied))
    path = Path(out)
    if path.is_dir():
        raise InputError(f"--out {path} is a folder; give a file name such as {path / (name + '.gguf')}")
    if not path.parent.is_dir() or not os.access(path.parent, os.W_OK | os.X_OK):
        raise InputError(f"--out {path}: the folder {path.parent} does not exist or cannot be written")
    from tqdm import tqdm
    quiet = not progress_bar or sparse or not sys.stderr.isatty()
    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="synth", disable=quiet) as bar:
        try:
            return write_gguf(out, spec, type_of, tied_output=tied, sparse=sparse, seed=seed,
                              split_max_bytes=split_max_bytes, name=name, progress=bar.update)
        except OSError as e:
            raise InputError(f"cannot write {out}: {e.strerror or e}") from e
