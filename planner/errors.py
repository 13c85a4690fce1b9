"""One exception tree for offload-tuner. The CLI prints `str(err)` on one line and exits 2 for any InputError."""
from __future__ import annotations


class OffloadTunerError(Exception):
    """Base of every error this project raises on purpose."""


class InputError(OffloadTunerError):
    """Bad input from the user: a file, a flag, a size, a budget. The message says what and what to do next."""


class GGUFError(InputError):
    """A file that is not a GGUF, is truncated, or declares counts or lengths it cannot hold."""


class UnknownArchitectureError(InputError):
    """general.architecture (or a preset's arch) is not one we can model."""


class FlagError(InputError):
    """A llama.cpp flag or value that llama.cpp itself would reject, or that we cannot express."""


class BudgetError(InputError):
    """No placement fits in the memory given."""


class RecordError(InputError):
    """A study's stored trial record this offload-tuner cannot read: written by a newer version, or damaged."""


class StorageError(InputError):
    """The study's storage failed: a truncated or garbage SQLite file, a full disk, a database server that went
    away. The message names the storage and what to do next; every trial finished before it is kept."""


def error_line(message: object) -> str:
    """The one line a front end shows for an error (the service's JSON `error`, its pages): the program's prefix
    and the message with its whitespace folded, so a multi-line message cannot break a log or a page."""
    return "offload-tuner: error: " + " ".join(str(message).split())
