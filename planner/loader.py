"""MODEL as the CLI takes it: a path to a .gguf (any shard of a split) or `preset:NAME[:QUANT]`."""
from __future__ import annotations

import logging
from pathlib import Path

from .errors import InputError
from .model import ModelInventory

log = logging.getLogger(__name__)


def load_model(text: str) -> ModelInventory:
    inv = _load(text)
    log.debug("model %s: %s, %d tensors, %d bytes of weights", text, inv.name or inv.source, len(inv.tensors),
              inv.file_bytes)
    return inv


def _load(text: str) -> ModelInventory:
    if text.startswith("preset:"):
        from .presets import load_preset
        return load_preset(text).inventory()
    path = Path(text)
    if not path.exists():
        raise InputError(f"no such model file: {text} (give a .gguf path or preset:NAME[:QUANT])")
    if path.is_dir():
        raise InputError(f"{text} is a directory; give the .gguf file (the first shard of a split model)")
    from .gguf_header import load_inventory
    return load_inventory(path)
