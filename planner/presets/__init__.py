"""Well-known models as data: GGUF metadata (as convert_hf_to_gguf.py writes it) plus a quant recipe.

`load_preset("Qwen3-30B-A3B:Q4_K_M")` expands a preset into a full ModelInventory through the same arch tables
that read real files (planner/archs.py), so a preset and a GGUF of the same model agree. Every preset also has
the recipes marked every_model in recipes.json (BF16: what convert_hf_to_gguf.py --outtype bf16 writes).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache, cache
from importlib import resources
from collections.abc import Callable

from ..archs import ArchSpec, build_inventory, spec_from_metadata
from ..errors import InputError
from ..ggml_types import fit_type
from ..model import ModelInventory

TypeOf = Callable[[str, tuple, "int | None"], str]


@dataclass(frozen=True)
class Preset:
    key: str                 # file stem, e.g. "qwen3-30b-a3b"
    name: str                # "Qwen3-30B-A3B"
    quant: str
    spec: ArchSpec
    type_of: TypeOf
    tied_output: bool
    source: str

    def inventory(self) -> ModelInventory:
        return _inventory(self.key, self.quant)


@cache
def _read(name: str) -> dict:            # a package file, read once (callers only read it)
    return json.loads(resources.files(__package__).joinpath(name).read_text())


@cache
def _index() -> dict[str, dict]:
    out = {}
    for res in resources.files(__package__).iterdir():
        if res.name.endswith(".json") and res.name != "recipes.json":
            out[res.name[:-5]] = json.loads(res.read_text())
    return out


def preset_names() -> list[str]:
    return sorted(d["name"] for d in _index().values())


def preset_models() -> list[str]:
    """Every preset as MODEL spells it: preset:NAME and preset:NAME:QUANT for each of its quants (the service's
    schema lists them)."""
    out = []
    for d in _index().values():
        quants = d["quants"] + [q for q in _every_model_quants() if q not in d["quants"]]
        out += [f"preset:{d['name']}", *(f"preset:{d['name']}:{q}" for q in quants)]
    return sorted(out)


def _more_bits(i: int, n: int) -> bool:
    # llama-quant.cpp use_more_bits(): the first and last eighth of layers, and every third in between
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def recipe(quant: str, n_layer: int) -> TypeOf:
    """type_of(name, shape, layer) for a quant recipe of recipes.json."""
    recipes = _read("recipes.json")
    if quant not in recipes:
        known = ", ".join(k for k in recipes if not k.startswith("_"))
        raise InputError(f"unknown quant {quant!r}; known: {known}")
    r = recipes[quant]
    rules = [(re.compile(p), t, cond) for p, t, cond in r["rules"]]

    def type_of(name: str, shape: tuple, layer: int | None) -> str:
        if len(shape) == 1 or name.endswith("_norm.weight") or ".ffn_gate_inp" in name or not name.endswith(".weight"):
            return "F32"    # norms, biases, sinks and routers stay F32 (convert_hf_to_gguf.py, llama-quant.cpp)
        for pattern, t, cond in rules:
            if pattern.search(name) and (cond is None or (layer is not None and _more_bits(layer, n_layer))):
                return fit_type(t, shape[0])
        return fit_type(r["default"], shape[0])
    return type_of


@cache
def _every_model_quants() -> tuple[str, ...]:
    """Recipes any preset has (marked every_model: BF16, what convert_hf_to_gguf.py writes from any checkpoint)."""
    return tuple(k for k, r in _read("recipes.json").items() if not k.startswith("_") and r.get("every_model"))


def _find(name: str) -> tuple[str, dict]:
    wanted = name.lower()
    for key, d in _index().items():
        if wanted in (key, d["name"].lower()):
            return key, d
    raise InputError(f"unknown preset {name!r}; known: {', '.join(preset_names())}")


def load_preset(text: str) -> Preset:
    """'NAME[:QUANT]' (also accepts a leading 'preset:')."""
    body = text[len("preset:"):] if text.startswith("preset:") else text
    name, _, quant = body.partition(":")
    key, d = _find(name)
    quant = quant or d["default_quant"]
    available = d["quants"] + [q for q in _every_model_quants() if q not in d["quants"]]
    if quant not in available:
        raise InputError(f"preset {d['name']} has no quant {quant!r}; available: {', '.join(available)}")
    arch = d["arch"]
    meta = {"general.architecture": arch, **{f"{arch}.{k}": v for k, v in d["metadata"].items()}}
    spec = spec_from_metadata(meta)
    if d.get("features"):
        spec = ArchSpec(spec.hparams, spec.features | frozenset(d["features"]), spec.q_lora_rank,
                        spec.head_dim_k_mla, spec.head_dim_v_mla)
    return Preset(key, d["name"], quant, spec, recipe(quant, spec.hparams.n_layer), d.get("tied_output", False),
                  d["source"])


@lru_cache(maxsize=32)
def _inventory(key: str, quant: str) -> ModelInventory:
    p = load_preset(f"{key}:{quant}")
    return build_inventory(p.spec, p.type_of, tied_output=p.tied_output, name=f"{p.name} {quant}",
                           source=f"preset:{p.name}:{quant}")
