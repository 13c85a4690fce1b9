"""A record a study stores as a JSON object, typed: StoredRow, the base of the study's settings (options.Settings)
and its rows of samples (records.ConfirmSample, records.ServedRun).

from_dict takes what any offload-tuner stored: a key the stored object lacks reads as the field's default and is
remembered (`absent`), and to_dict writes the other fields, in field order, under their stored keys, so a record
read and written back is the JSON it was. A subclass is a frozen dataclass with an `absent` field
(compare=False), and says in class tables where a field is stored under another key (KEYS) and how its stored
value is read and written where that is not as it is (READ, WRITE).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import fields
from typing import Any, ClassVar


class StoredRow:
    KEYS: ClassVar[dict[str, str]] = {}                          # field -> its stored key, where they differ
    READ: ClassVar[dict[str, Callable[[Any], Any]]] = {}         # field -> its value from the stored one
    WRITE: ClassVar[dict[str, Callable[[Any], Any]]] = {}        # field -> its stored value
    absent: frozenset[str]

    @classmethod
    def stored_names(cls) -> list[tuple[str, str]]:
        """(field, stored key) of every stored field, in order."""
        return [(f.name, cls.KEYS.get(f.name, f.name)) for f in fields(cls) if f.name != "absent"]  # type: ignore

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Any:
        """The record of a stored object (the READ function's error for a value it cannot read)."""
        names = cls.stored_names()
        return cls(**{n: cls.READ.get(n, _same)(d[k]) for n, k in names if k in d},
                   absent=frozenset(n for n, k in names if k not in d))

    def to_dict(self) -> dict[str, Any]:
        return {k: self.WRITE.get(n, _same)(getattr(self, n)) for n, k in self.stored_names() if n not in self.absent}


def _same(value: Any) -> Any:
    return value
