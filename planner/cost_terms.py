"""The cost model's terms as typed keys: what a term prices (its kind) and where (its device).

planner.cost.predict adds seconds per Term; tuner.cost_fit groups them by kind (and, for a per-device
kind, by whether the device is a GPU), so nothing parses text keys and a kind nobody knows is an error at once
instead of a term that silently lands in the refit's "fixed" group. docs/cost_model.md describes each kind.

    per device (a GPU "CUDAi", or "CPU"):  read, kv (TG); compute, attn, output (PP); disk (both, the CPU's only:
                                           its weights the RAM cannot hold, read back from disk)
    machine-wide (device ""):              upload, upload_calls, sync, launch

str(term) is the text key the breakdown has always been written with (CUDA0_read, cpu_read, upload, ...), so
Prediction.breakdown, the benchmarks' JSON and the reports read as before.
"""
from __future__ import annotations

from typing import Literal, NamedTuple, get_args

from .plan import is_gpu

TermKind = Literal["read", "kv", "compute", "attn", "output", "disk", "upload", "upload_calls", "sync", "launch"]
KINDS: tuple[str, ...] = get_args(TermKind)
DEVICE_KINDS: frozenset[str] = frozenset({"read", "kv", "compute", "attn", "output", "disk"})
MACHINE_KINDS: frozenset[str] = frozenset(KINDS) - DEVICE_KINDS


class _TermFields(NamedTuple):
    kind: TermKind
    device: str


# One instance per (kind, device): predict() adds a few thousand terms per call, and an interned NamedTuple costs
# a dict lookup where a validated new object would cost several times the text key it replaces.
_INTERNED: dict[tuple[str, str], Term] = {}


class Term(_TermFields):
    """A cost term's key. A NamedTuple (hashed in C, interned) because predict() adds one per weight tensor."""
    __slots__ = ()

    def __new__(cls, kind: TermKind, device: str = "") -> Term:
        term = _INTERNED.get((kind, device))
        if term is None:
            _check(kind, device)
            term = _INTERNED[(kind, device)] = super().__new__(cls, kind, device)
        return term

    @property
    def on_gpu(self) -> bool:
        return is_gpu(self.device)

    def __str__(self) -> str:
        if not self.device:
            return self.kind
        return f"{'cpu' if self.device == 'CPU' else self.device}_{self.kind}"


def _check(kind: str, device: str) -> None:
    if kind in DEVICE_KINDS:
        if device != "CPU" and not is_gpu(device):
            raise ValueError(f"cost term {kind!r} is priced per device: give CUDAi or CPU, not {device!r}")
    elif kind in MACHINE_KINDS:
        if device:
            raise ValueError(f"cost term {kind!r} is machine-wide: it takes no device ({device!r} given)")
    else:
        raise ValueError(f"unknown cost term kind {kind!r}; known: {', '.join(KINDS)}")


def text_keys(phase: str, terms: dict[Term, float]) -> dict[str, float]:
    """The readable form of one phase's terms: {"tg.CUDA0_read": seconds, ...}."""
    return {f"{phase}.{t}": v for t, v in terms.items()}
