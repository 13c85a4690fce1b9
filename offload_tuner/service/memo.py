"""The same question, the same answer: what plan, explain and inspect answer (their JSON, serialized) is kept per
request, the last MEMO_SIZE of them. A plan costs ~1 s of CPU; many clients of a service ask the same few (the web
view reloaded, a script polling), and two that ask at once get one computation. A request that names a file (a
.gguf, a calibrated hardware profile) is keyed on the file's size and modification time too: an edited file is
read again. Errors are not kept."""
from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

MEMO_SIZE = 256


def _files(req: Any) -> tuple:
    """(size, mtime) of the files REQ names: its model unless a preset, its hardware profile if a path."""
    out = []
    for text in (getattr(req, "model", None), getattr(req, "hardware", None)):
        if text and not text.startswith("preset:") and ("/" in text or text.endswith((".json", ".gguf"))):
            try:
                st = Path(text).stat()
                out.append((text, st.st_size, st.st_mtime_ns))
            except OSError:
                out.append((text, None))
    return tuple(out)


class Memo:
    def __init__(self, size: int = MEMO_SIZE):
        self.size = size
        self._kept: OrderedDict[tuple, bytes] = OrderedDict()
        self._running: dict[tuple, threading.Lock] = {}
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def get(self, command: str, req: Any, answer: Callable[[], bytes]) -> bytes:
        """answer() for (COMMAND, REQ), computed once while it is kept; concurrent askers wait for the first."""
        key = (command, req, _files(req))
        with self._lock:
            if key in self._kept:
                self.hits += 1
                self._kept.move_to_end(key)
                return self._kept[key]
            running = self._running.setdefault(key, threading.Lock())
        with running:
            with self._lock:
                if key in self._kept:             # computed while this one waited
                    self.hits += 1
                    return self._kept[key]
                self.misses += 1
            try:
                value = answer()
            finally:
                with self._lock:
                    self._running.pop(key, None)
            with self._lock:
                self._kept[key] = value
                while len(self._kept) > self.size:
                    self._kept.popitem(last=False)
            return value
