"""Where weight values come from: a GGUF file (dequantized with gguf-py) or synthesized from the inventory.

A source fills a destination tensor the placement allocated (any device, the compute dtype, the tensor's torch
shape, possibly a strided view of a packed buffer): `source.fill(name, out)`. Torch shapes are GGUF shapes
reversed, so `ffn_up_exps` of ggml shape [n_embd, n_ff_exp, n_expert] is [E, F, D] here, experts stacked first.

Synthetic weights are deterministic per (seed, tensor name), whatever device they land on, so the same model
placed two ways computes the same function. Small tensors are fresh normals; large ones are tiled from a 32 MB
pool of normals starting at a per-tensor offset (a 60 GB model synthesizes at memory-copy speed). Routing
"zipf:S" adds a per-layer bias -S * ln(1 + rank) to the router logits (ranks a seeded permutation of the
experts), so a few "hot" experts take most tokens; "uniform" adds nothing (random routers spread tokens evenly).
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from planner.errors import InputError
from planner.model import ModelInventory

POOL_ELEMENTS = (1 << 24) - 3     # synthetic pool: 16M values (a prime: expert slices never realign)
SMALL_ELEMENTS = 1 << 22          # tensors up to this size get fresh normals
DEQUANT_CHUNK_ELEMENTS = 1 << 24  # GGUF tensors are dequantized in slices of about this many values
# gguf-py dequantizes these (gguf.quants: F32, F16 natively; the rest through its quant classes).
GGUF_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
              "Q6_K", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M", "IQ4_NL", "IQ4_XS",
              "TQ1_0", "TQ2_0", "MXFP4")


def torch_shape(ggml_shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(reversed(ggml_shape))


def _slices(out: torch.Tensor, max_elements: int) -> list[tuple[slice | int, int, int]]:
    """(index into out's first dim, first flat element, element count): pieces of at most ~max_elements."""
    if out.dim() <= 1:
        return [(slice(None), 0, out.numel())]
    inner = out[0].numel()
    if out.dim() >= 3 or inner >= max_elements:
        return [(i, i * inner, inner) for i in range(out.shape[0])]
    rows = max(1, max_elements // inner)
    return [(slice(r, min(r + rows, out.shape[0])), r * inner, (min(r + rows, out.shape[0]) - r) * inner)
            for r in range(0, out.shape[0], rows)]


class WeightSource(Protocol):
    kind: str     # "gguf" or "synthetic"

    def fill(self, name: str, out: torch.Tensor) -> None:
        """Write tensor `name` (torch shape out.shape) into `out`."""

    def router_bias(self, layer: int) -> torch.Tensor | None:
        """An extra float32 [n_expert] bias on layer's router logits (synthetic hot experts), or None."""


# ---- GGUF -----------------------------------------------------------------------------------------------------

class GGUFSource:
    """Tensors of a GGUF file (or split model), dequantized by gguf-py into the destination's dtype."""
    kind = "gguf"

    def __init__(self, path: str | Path) -> None:
        from planner.gguf_header import read_header
        try:
            from gguf import GGMLQuantizationType
            from gguf.quants import dequantize
        except ImportError as e:
            raise InputError("loading weights from a GGUF needs the gguf package (pip install gguf); "
                             "synthetic weights do not") from e
        self._qtype, self._dequantize = GGMLQuantizationType, dequantize
        self.header = read_header(path)
        self.infos = {t.name: t for t in self.header.tensors}
        self.metadata = self.header.metadata
        self._maps: dict[int, np.memmap] = {}

    def _raw(self, name: str) -> tuple[np.ndarray, str, tuple[int, ...]]:
        info = self.infos[name]
        shard = self.header.shards[info.shard]
        if info.shard not in self._maps:
            self._maps[info.shard] = np.memmap(shard.path, dtype=np.uint8, mode="r")
        start = shard.data_offset + info.offset
        return self._maps[info.shard][start:start + info.nbytes], info.type_name, info.shape

    def fill(self, name: str, out: torch.Tensor) -> None:
        raw, type_name, shape = self._raw(name)
        if type_name not in GGUF_TYPES:
            raise InputError(f"{name} is {type_name}; the torch engine dequantizes {', '.join(GGUF_TYPES)}")
        qtype = self._qtype[type_name]
        ne0 = shape[0]
        row_bytes = raw.size // max(1, math.prod(shape[1:]))
        rows = raw.reshape(-1, row_bytes)
        for index, first, count in _slices(out, DEQUANT_CHUNK_ELEMENTS):
            part = rows[first // ne0:(first + count) // ne0]
            values = np.asarray(self._dequantize(np.ascontiguousarray(part), qtype), dtype=np.float32)
            if not values.flags.writeable:        # F32 comes back as a view of the read-only map
                values = values.copy()
            target = out[index]
            target.copy_(torch.from_numpy(values.reshape(target.shape)))

    def router_bias(self, layer: int) -> torch.Tensor | None:
        return None


# ---- synthetic ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Routing:
    zipf: float = 0.0             # 0: uniform

    @classmethod
    def parse(cls, text: str) -> Routing:
        if text == "uniform":
            return cls()
        if text.startswith("zipf:"):
            try:
                s = float(text[5:])
            except ValueError:
                s = -1.0
            if s > 0:
                return cls(s)
        raise InputError(f"bad routing {text!r}: use 'uniform' or 'zipf:S' with S > 0 (e.g. zipf:1.2)")


def _seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) & 0x7FFF_FFFF


def _cycle(pool: torch.Tensor, offset: int, count: int) -> torch.Tensor:
    """count values of pool read from offset on, wrapping around."""
    if offset + count <= len(pool):
        return pool[offset:offset + count]
    pieces, left = [], count
    while left:
        n = min(len(pool) - offset, left)
        pieces.append(pool[offset:offset + n])
        left -= n
        offset = 0
    return torch.cat(pieces)


class SyntheticSource:
    """Random weights for any inventory, at full size, no file. Values (std chosen so activations stay O(1)):
    norms 1 + N(0, 0.02); biases, exp_probs_b N(0, 0.02); sinks N(0, 1); token_embd N(0, 1); every matrix
    N(0, 1/fan_in) with fan_in its ggml ne0."""
    kind = "synthetic"

    def __init__(self, inv: ModelInventory, seed: int = 0, routing: str = "uniform") -> None:
        self.inv, self.seed, self.routing = inv, seed, Routing.parse(routing)
        self._pools: dict[tuple[float, torch.dtype, torch.device], torch.Tensor] = {}

    def _law(self, name: str) -> tuple[float, float]:
        """(mean, std) of tensor `name`."""
        t = self.inv.by_name[name]
        if name.startswith("token_embd"):
            return 0.0, 1.0
        if len(t.shape) == 1 or name.endswith(".bias"):
            if "norm" in name:
                return 1.0, 0.02
            if "sinks" in name:
                return 0.0, 1.0
            if name.endswith(".bias"):
                return 0.0, 0.02
            return 0.0, 1.0 / math.sqrt(t.shape[0])      # ffn_gate_inp_shexp: a dot-product vector
        return 0.0, 1.0 / math.sqrt(t.shape[0])

    def _pool(self, std: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (std, dtype, device)
        if key not in self._pools:
            g = torch.Generator().manual_seed(_seed(self.seed, f"pool{std}"))
            pool = (torch.randn(POOL_ELEMENTS, generator=g) * std).to(dtype)
            self._pools[key] = pool.to(device)
        return self._pools[key]

    def fill(self, name: str, out: torch.Tensor) -> None:
        mean, std = self._law(name)
        if out.numel() <= SMALL_ELEMENTS:
            g = torch.Generator().manual_seed(_seed(self.seed, name))
            out.copy_(torch.randn(tuple(out.shape), generator=g) * std + mean)
            return
        pool = self._pool(std, out.dtype, out.device)
        start = _seed(self.seed, name) % POOL_ELEMENTS
        for index, first, count in _slices(out, POOL_ELEMENTS):
            target = out[index]
            target.copy_(_cycle(pool, (start + first) % len(pool), count).view(target.shape))
            if mean:
                target.add_(mean)

    def pool_bytes(self, placed: dict[str, tuple[str, torch.dtype]]) -> dict[str, int]:
        """{device: bytes} of the pools fill() keeps on each device for these tensors ({name: (device, dtype)}):
        one pool of POOL_ELEMENTS per (std, dtype) among the tensors too large for fresh normals (they stay
        allocated with the source: 32 MiB each in bf16)."""
        keys = {(dev, self._law(name)[1], dtype) for name, (dev, dtype) in placed.items()
                if math.prod(self.inv.by_name[name].shape) > SMALL_ELEMENTS}
        out: dict[str, int] = {}
        for dev, _, dtype in keys:          # torch's caching allocator hands out blocks of 512 bytes
            out[dev] = out.get(dev, 0) + -(-POOL_ELEMENTS * dtype.itemsize // 512) * 512
        return out

    def router_bias(self, layer: int) -> torch.Tensor | None:
        if not self.routing.zipf:
            return None
        n = self.inv.hparams.n_expert
        g = torch.Generator().manual_seed(_seed(self.seed, f"zipf.{layer}"))
        rank = torch.randperm(n, generator=g).float()
        return -self.routing.zipf * torch.log1p(rank)


def open_source(inv: ModelInventory, weights: str = "auto", seed: int = 0, routing: str = "uniform") -> WeightSource:
    """weights: "synthetic", "gguf" (inv.source must be a file) or "auto" (the file when inv.source is one)."""
    if weights not in ("auto", "synthetic", "gguf"):
        raise InputError(f"bad weights {weights!r}: use auto, synthetic or gguf")
    path = Path(inv.source) if inv.source and not inv.source.startswith("preset:") else None
    if weights == "gguf" or (weights == "auto" and path is not None and path.is_file()):
        if path is None or not path.is_file():
            raise InputError(f"weights='gguf' needs a model file; {inv.source or 'this inventory'} is not one")
        if routing != "uniform":
            raise InputError("routing applies to synthetic weights only; a GGUF routes as it was trained")
        return GGUFSource(path)
    return SyntheticSource(inv, seed=seed, routing=routing)
