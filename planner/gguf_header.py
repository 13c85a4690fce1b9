"""GGUF header reader: metadata and tensor infos of a local file or a split model, never the tensor data.

Our own reader rather than gguf.GGUFReader, which raises on type ids it does not know (ik types), has no split
support and trusts every count the file declares. Headers are untrusted input (STYLE.md item 7): every count
and length is bounded by a named limit and by the bytes left in the file, and anything wrong raises GGUFError
with one line naming the file and the problem.

Format (docs/llamacpp.md section 9; ggml/src/gguf.cpp): magic "GGUF", u32 version, u64 tensor
count, u64 kv count, kv pairs (string key, u32 value type, value), tensor infos (string name, u32 n_dims, u64
ne[n_dims], u32 type, u64 offset), padding to general.alignment, then the data. All little-endian.
"""
from __future__ import annotations

import mmap
import os
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, overload
from collections.abc import Iterator

import numpy as np

from .archs import make_tensor, spec_from_metadata
from .errors import GGUFError
from .files import open_regular
from .ggml_types import BY_ID, IK_REPACKED_IDS, type_name
from .model import ModelInventory

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)     # v1 used 32-bit counts; llama.cpp dropped it too
DEFAULT_ALIGNMENT = 32          # GGUF_DEFAULT_ALIGNMENT

# Limits on what a header may declare. ggml's own are in gguf.cpp (GGUF_MAX_STRING_LENGTH, ..._ARRAY_ELEMENTS,
# GGML_MAX_DIMS, GGML_MAX_NAME); the counts are far above any real model (DeepSeek-V3: ~1,100 tensors, ~50 keys).
MAX_TENSORS = 1 << 16
MAX_KV = 1 << 16
MAX_KEY_LENGTH = 1 << 16
MAX_STRING_LENGTH = 1 << 30
MAX_ARRAY_LENGTH = 1 << 30
MAX_DIMS = 4
MAX_TENSOR_NAME = 63            # GGML_MAX_NAME - 1: ggml rejects longer names
MAX_TYPE_ID = 1 << 16           # ggml: < GGML_TYPE_COUNT (43); ik: < 400.
# ik_llama.cpp ids (its ggml/include/ggml.h) that no size table here covers; any other unknown id is refused by
# both loaders (gguf.cpp: "invalid ggml type", or a removed type with block size 0).
IK_UNSIZED_IDS = frozenset({31, 32, 33, 36, 97, 98, 99, 134, 135, 136, 147, 148, 149, 150, 151, 158})
MAX_ALIGNMENT = 1 << 30
MAX_SHARDS = 4096
MAX_ELEMENTS = (1 << 63) - 1    # ggml: the element count must fit in int64
MAX_MESSAGE = 300               # characters of an error message (file-supplied names are quoted, cut short)

# GGUF value types (gguf.cpp enum gguf_type): id -> (struct format, size) for fixed-size scalars.
_SCALARS: dict[int, tuple[str, int]] = {
    0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4), 6: ("<f", 4),
    7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8),
}
_NUMPY: dict[int, str] = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1",
                          10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY, _BOOL, _UINT32 = 8, 9, 7, 4
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")

# gguf-split's shard names (llama.cpp src/llama.cpp llama_split_path: "%s-%05d-of-%05d.gguf").
_SPLIT_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


class StringArray(Sequence[str]):
    """A GGUF string array kept as its raw bytes: len() is free, strings are decoded only when asked for.

    tokenizer.ggml.tokens holds ~129k strings in DeepSeek-V3; the planner only needs its length.
    """

    def __init__(self, count: int, raw: bytes) -> None:
        self._count = count
        self._raw = raw             # count x (u64 length, utf-8 bytes), already bounds-checked
        self._starts: list[int] | None = None

    def __len__(self) -> int:
        return self._count

    def _index(self) -> list[int]:
        if self._starts is None:
            starts, pos, unpack = [], 0, _U64.unpack_from
            for _ in range(self._count):
                starts.append(pos)
                pos += 8 + unpack(self._raw, pos)[0]
            self._starts = starts
        return self._starts

    def _decode(self, i: int) -> str:
        start = self._index()[i]
        n = _U64.unpack_from(self._raw, start)[0]
        return self._raw[start + 8:start + 8 + n].decode("utf-8", errors="replace")

    @overload
    def __getitem__(self, i: int) -> str: ...
    @overload
    def __getitem__(self, i: slice) -> list[str]: ...

    def __getitem__(self, i: int | slice) -> str | list[str]:
        if isinstance(i, slice):
            return [self._decode(j) for j in range(*i.indices(self._count))]
        if not -self._count <= i < self._count:
            raise IndexError(f"string array index {i} out of range ({self._count})")
        return self._decode(i % self._count)

    def __iter__(self) -> Iterator[str]:
        return (self._decode(i) for i in range(self._count))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, StringArray):
            return self._count == other._count and self._raw == other._raw
        if isinstance(other, (list, tuple)):
            return len(other) == self._count and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"StringArray({self._count} strings)"


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]      # ne order (ne0 first)
    type_id: int
    type_name: str              # "TYPE_<id>" / "IK_R<id>" for ids no table sizes
    offset: int                 # relative to the data start of its shard
    nbytes: int                 # from the type table (incl. ik row metadata), else from the data offsets
    shard: int = 0              # 0-based index into GGUFHeader.shards


@dataclass(frozen=True)
class Shard:
    path: Path
    data_offset: int            # absolute file offset of the data section
    alignment: int
    file_size: int


@dataclass(frozen=True)
class GGUFHeader:
    """A model's header. For a split model: path, version, metadata, alignment and data_offset are shard 1's,
    tensors are every shard's in order, file_size is the bytes of all shards together."""
    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: tuple[TensorInfo, ...]
    alignment: int
    data_offset: int
    file_size: int
    shards: tuple[Shard, ...] = ()

    @property
    def data_bytes(self) -> int:
        """Bytes of tensor data (padding excluded)."""
        return sum(t.nbytes for t in self.tensors)


# ---- one file ---------------------------------------------------------------------------------------------

class _Cursor:
    """Bounds-checked little-endian reads from a file's bytes; every failure is a one-line GGUFError."""

    def __init__(self, buf: mmap.mmap, size: int, path: Path) -> None:
        self.buf, self.size, self.path, self.pos = buf, size, path, 0

    def error(self, msg: str) -> GGUFError:
        # one line of reasonable length, whatever names and keys the file holds
        msg = msg if len(msg) <= MAX_MESSAGE else msg[:MAX_MESSAGE] + "..."
        return GGUFError(f"{self.path}: {msg}".replace("\n", "\\n"))

    def need(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise self.error(f"truncated: {what} at byte {self.pos} needs {n} bytes, the file has "
                             f"{self.size - self.pos} left")

    def scalar(self, fmt: str, size: int, what: str) -> Any:
        self.need(size, what)
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += size
        return value

    def u32(self, what: str) -> int:
        return self.scalar("<I", 4, what)

    def u64(self, what: str) -> int:
        return self.scalar("<Q", 8, what)

    def count(self, what: str, limit: int, min_item_bytes: int) -> int:
        """A declared count, bounded by `limit` and by what the rest of the file could hold."""
        n = self.u64(what)
        if n > limit:
            raise self.error(f"{what} is {n}, more than the limit of {limit}")
        if n * min_item_bytes > self.size - self.pos:
            raise self.error(f"truncated: {what} is {n} but only {self.size - self.pos} bytes are left")
        return n

    def raw_string(self, what: str, limit: int) -> bytes:
        n = self.u64(f"length of {what}")
        if n > limit:
            raise self.error(f"{what} is {n} bytes long, more than the limit of {limit}")
        self.need(n, what)
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def name(self, what: str, limit: int) -> str:
        raw = self.raw_string(what, limit)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.error(f"{what} {raw[:40]!r} is not UTF-8") from None

    def skip_strings(self, n: int, what: str) -> int:
        """Walk n strings without decoding them (the hot loop for 129k-token vocabularies); returns the end."""
        pos, end, buf, unpack = self.pos, self.size, self.buf, _U64.unpack_from
        for i in range(n):
            if pos + 8 > end:
                raise self.error(f"truncated: string {i} of {what} at byte {pos}")
            length = unpack(buf, pos)[0]
            if length > MAX_STRING_LENGTH:
                raise self.error(f"string {i} of {what} is {length} bytes long, more than the limit")
            pos += 8 + length
        if pos > end:
            raise self.error(f"truncated: {what} ends at byte {pos}, the file has {end}")
        return pos


def _value(cur: _Cursor, vtype: int, key: str) -> Any:
    if vtype in _SCALARS:
        fmt, size = _SCALARS[vtype]
        return cur.scalar(fmt, size, f"value of {key!r}")
    if vtype == _STRING:
        return cur.raw_string(f"value of {key!r}", MAX_STRING_LENGTH).decode("utf-8", errors="replace")
    if vtype == _ARRAY:
        return _array(cur, key)
    raise cur.error(f"key {key!r} has unknown value type {vtype}")


def _array(cur: _Cursor, key: str) -> Any:
    etype = cur.u32(f"element type of {key!r}")
    if etype == _STRING:
        n = cur.count(f"length of array {key!r}", MAX_ARRAY_LENGTH, 8)
        start = cur.pos
        cur.pos = cur.skip_strings(n, f"array {key!r}")
        return StringArray(n, cur.buf[start:cur.pos])
    if etype not in _SCALARS:
        what = "nested arrays, which llama.cpp rejects too" if etype == _ARRAY else f"unknown element type {etype}"
        raise cur.error(f"array {key!r} has {what}")
    size = _SCALARS[etype][1]
    n = cur.count(f"length of array {key!r}", MAX_ARRAY_LENGTH, size)
    values = np.frombuffer(cur.buf[cur.pos:cur.pos + n * size], dtype=_NUMPY[etype]).tolist()
    cur.pos += n * size
    return [bool(v) for v in values] if etype == _BOOL else values


def _metadata(cur: _Cursor, n_kv: int) -> tuple[dict[str, Any], dict[str, int]]:
    meta: dict[str, Any] = {}
    types: dict[str, int] = {}
    for i in range(n_kv):
        key = cur.name(f"key {i}", MAX_KEY_LENGTH)
        if key in meta:
            raise cur.error(f"duplicate key {key!r}")
        types[key] = cur.u32(f"value type of {key!r}")
        meta[key] = _value(cur, types[key], key)
    return meta, types


def _alignment(cur: _Cursor, meta: dict[str, Any], types: dict[str, int]) -> int:
    if "general.alignment" not in meta:
        return DEFAULT_ALIGNMENT
    value = meta["general.alignment"]
    if types["general.alignment"] != _UINT32:
        raise cur.error(f"general.alignment has value type {types['general.alignment']}, llama.cpp needs uint32")
    if value <= 0 or value & (value - 1) or value > MAX_ALIGNMENT:
        raise cur.error(f"general.alignment {value} is not a power of two up to {MAX_ALIGNMENT}")
    return value


def _tensor_info(cur: _Cursor, i: int, alignment: int) -> tuple[str, tuple[int, ...], int, int]:
    name = cur.name(f"name of tensor {i}", 1 << 16)
    if len(name.encode()) > MAX_TENSOR_NAME:
        raise cur.error(f"tensor name {name[:80]!r} is longer than {MAX_TENSOR_NAME} bytes (ggml's limit)")
    n_dims = cur.u32(f"n_dims of {name!r}")
    if not 1 <= n_dims <= MAX_DIMS:
        raise cur.error(f"tensor {name!r} has {n_dims} dimensions (1 to {MAX_DIMS} allowed)")
    cur.need(8 * n_dims, f"shape of {name!r}")
    shape = struct.unpack_from(f"<{n_dims}Q", cur.buf, cur.pos)
    cur.pos += 8 * n_dims
    n = 1
    for d in shape:
        if d == 0 or d > MAX_ELEMENTS:
            raise cur.error(f"tensor {name!r} has dimension {d} in shape {list(shape)}")
        n *= d
    if n > MAX_ELEMENTS:
        raise cur.error(f"tensor {name!r} of shape {list(shape)} has more than 2^63 elements")
    type_id = cur.u32(f"type of {name!r}")
    if type_id >= MAX_TYPE_ID:
        raise cur.error(f"tensor {name!r} has type id {type_id}, beyond any known ggml type")
    known = BY_ID.get(type_id)
    if known is None and type_id not in IK_REPACKED_IDS and type_id not in IK_UNSIZED_IDS:
        raise cur.error(f"tensor {name!r} has type id {type_id}, which neither llama.cpp nor ik_llama.cpp loads "
                        "(a removed or undefined ggml type)")
    if known is not None and shape[0] % known.block:
        raise cur.error(f"tensor {name!r}: row of {shape[0]} elements is not a multiple of {known.name}'s "
                        f"block of {known.block}")
    offset = cur.u64(f"offset of {name!r}")
    if offset % alignment:
        raise cur.error(f"tensor {name!r} data offset {offset} is not a multiple of the alignment {alignment}")
    return name, tuple(shape), type_id, offset


def _size_from_span(shape: tuple[int, ...], span: int, alignment: int) -> int:
    """Bytes of a tensor no table sizes, from the room before the next tensor: a whole number of rows.

    The padding after a tensor is < alignment, so with at least `alignment` rows only one multiple of the row
    count lies in (span - alignment, span]. With fewer rows the span (an upper bound) is the answer.
    """
    rows = 1
    for d in shape[1:]:
        rows *= d
    return span - span % rows if rows >= alignment else span


def _sizes(cur: _Cursor, infos: list[tuple[str, tuple[int, ...], int, int]], data_size: int,
           alignment: int) -> list[int]:
    """nbytes per tensor: the type table where it knows the type, checked against the data offsets."""
    order = sorted(range(len(infos)), key=lambda k: infos[k][3])
    nbytes = [0] * len(infos)
    for rank, k in enumerate(order):
        name, shape, type_id, offset = infos[k]
        end = infos[order[rank + 1]][3] if rank + 1 < len(order) else data_size
        span = end - offset
        known = BY_ID.get(type_id)
        size = known.nbytes(shape) if known is not None else _size_from_span(shape, span, alignment)
        if size > span or size == 0:
            if rank + 1 == len(order):
                raise cur.error(f"truncated: tensor {name!r} needs {size} bytes at data offset {offset}, the data "
                                f"section has {max(span, 0)}")
            other = infos[order[rank + 1]][0]
            raise cur.error(f"tensor {name!r} ({size} bytes at data offset {offset}) overlaps tensor {other!r} "
                            f"at {end}")
        nbytes[k] = size
    return nbytes


def _check_contiguous(cur: _Cursor, infos: list[tuple[str, tuple[int, ...], int, int]], nbytes: list[int],
                      alignment: int) -> None:
    """gguf.cpp gguf_init_from_file_impl: tensor i's offset must be the padded sizes of tensors 0..i-1 summed
    (data in header order, no gaps, no overlap); llama.cpp refuses the file otherwise."""
    expected = 0
    for (name, _, type_id, offset), size in zip(infos, nbytes):
        if type_id not in BY_ID:      # sized from the offsets: nothing to compare
            expected = offset + size + (-size) % alignment
            continue
        if offset != expected:
            raise cur.error(f"tensor {name!r} has data offset {offset}, llama.cpp expects {expected} (tensor data "
                            "must follow the header order without gaps)")
        expected += size + (-size) % alignment


@dataclass(frozen=True)
class _File:
    version: int
    metadata: dict[str, Any]
    tensors: tuple[TensorInfo, ...]
    shard: Shard


def _parse(cur: _Cursor, shard_index: int) -> _File:
    cur.need(4, "magic")
    magic = cur.buf[0:4]
    if magic != MAGIC:
        raise cur.error(f"not a GGUF file (magic {magic!r})")
    cur.pos = 4
    version = cur.u32("version")
    if version & 0xFFFF == 0 and version:
        raise cur.error(f"GGUF version {version:#x} looks byte-swapped: big-endian files are not supported")
    if version not in SUPPORTED_VERSIONS:
        raise cur.error(f"unsupported GGUF version {version} (offload-tuner reads versions 2 and 3)")
    n_tensors = cur.count("tensor count", MAX_TENSORS, 24)     # name length + n_dims + type + offset
    n_kv = cur.count("key-value count", MAX_KV, 13)            # key length + value type + 1 byte of value
    meta, types = _metadata(cur, n_kv)
    alignment = _alignment(cur, meta, types)
    infos = [_tensor_info(cur, i, alignment) for i in range(n_tensors)]
    seen: set[str] = set()
    for name, *_ in infos:
        if name in seen:
            raise cur.error(f"duplicate tensor name {name!r}")
        seen.add(name)
    data_offset = cur.pos + (-cur.pos) % alignment
    if infos and data_offset > cur.size:
        raise cur.error(f"truncated: the data section would start at byte {data_offset}, the file has {cur.size}")
    data_size = cur.size - data_offset
    for name, _, _, offset in infos:
        if offset >= data_size:
            raise cur.error(f"tensor {name!r} data offset {offset} is beyond the end of the file "
                            f"({data_size} bytes of data)")
    nbytes = _sizes(cur, infos, data_size, alignment)
    _check_contiguous(cur, infos, nbytes, alignment)
    tensors = tuple(TensorInfo(name, shape, type_id, type_name(type_id), offset, size, shard_index)
                    for (name, shape, type_id, offset), size in zip(infos, nbytes))
    return _File(version, meta, tensors, Shard(cur.path, data_offset, alignment, cur.size))


def _read_file(path: Path, shard_index: int = 0) -> _File:
    try:
        with open_regular(path, "model", GGUFError) as f:       # a FIFO or a device is refused before a byte is read
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                raise GGUFError(f"{path}: not a GGUF file (empty)")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _parse(_Cursor(buf, size, path), shard_index)
    except OSError as e:
        raise GGUFError(f"{path}: cannot read: {e.strerror or e}") from e


# ---- split models -----------------------------------------------------------------------------------------

def _split_int(f: _File, key: str, path: Path) -> int | None:
    value = f.metadata.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise GGUFError(f"{path}: {key} is {value!r}, expected an integer")
    return value


def first_shard(path: str) -> str:
    """The path llama.cpp must be given for a split model: for a shard's name (PREFIX-0000i-of-0000K.gguf) the first
    shard's, PREFIX-00001-of-0000K.gguf, in the folder as written; any other path as it is. llama.cpp loads a split
    only from its first shard ("model must be loaded with the first split", src/llama-model-loader.cpp)."""
    folder, name = os.path.split(path)
    m = _SPLIT_NAME.match(name)
    if m is None or int(m["no"]) == 1:
        return path
    return os.path.join(folder, f"{m['prefix']}-{1:0{len(m['no'])}d}-of-{m['count']}.gguf")


def _shard_paths(path: Path, count: int) -> list[Path]:
    m = _SPLIT_NAME.match(path.name)
    if m is None:
        raise GGUFError(f"{path}: split.count is {count} but the name does not end in -NNNNN-of-NNNNN.gguf, "
                        f"so the other shards cannot be found")
    if int(m["count"]) != count:
        raise GGUFError(f"{path}: the name says {int(m['count'])} shards but split.count is {count}")
    return [path.with_name(f"{m['prefix']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


def _read_split(given: Path, first: _File, count: int) -> GGUFHeader:
    if count > MAX_SHARDS:
        raise GGUFError(f"{given}: split.count {count} is more than the limit of {MAX_SHARDS}")
    paths = _shard_paths(given, count)
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        raise GGUFError(f"{given}: split model of {count} shards lacks {', '.join(missing)} (in {given.parent})")
    files: list[_File] = []
    tensors: list[TensorInfo] = []
    seen: set[str] = set()
    for i, p in enumerate(paths):
        f = first if i == 0 and p == given else _read_file(p, i)   # `first` was read as shard 0
        no, n_split = _split_int(f, "split.no", p), _split_int(f, "split.count", p)
        if no != i or n_split != count:
            raise GGUFError(f"{p}: split.no={no}, split.count={n_split}; expected shard {i} of {count}")
        total = _split_int(f, "split.tensors.count", p)
        if total is None or (files and total != _split_int(files[0], "split.tensors.count", p)):
            raise GGUFError(f"{p}: split.tensors.count is {total}, which does not match shard 1")
        for t in f.tensors:
            if t.name in seen:
                raise GGUFError(f"{p}: tensor {t.name!r} is also in an earlier shard")
            seen.add(t.name)
        tensors.extend(f.tensors)
        files.append(f)
    head = files[0]
    if len(tensors) != _split_int(head, "split.tensors.count", paths[0]):
        raise GGUFError(f"{paths[0]}: split.tensors.count is {head.metadata['split.tensors.count']} but the "
                        f"{count} shards hold {len(tensors)} tensors")
    shards = tuple(f.shard for f in files)
    return GGUFHeader(paths[0], head.version, head.metadata, tuple(tensors), head.shard.alignment,
                      head.shard.data_offset, sum(s.file_size for s in shards), shards)


def read_header(path: str | os.PathLike[str]) -> GGUFHeader:
    """Header of a GGUF file; for a split model (any of its shards) all shards' tensors, shard 1's metadata."""
    path = Path(path)
    first = _read_file(path)
    count = _split_int(first, "split.count", path)
    if count is None or count <= 1:
        s = first.shard
        return GGUFHeader(path, first.version, first.metadata, first.tensors, s.alignment, s.data_offset,
                          s.file_size, (s,))
    return _read_split(path, first, count)


def load_inventory(path: str | os.PathLike[str]) -> ModelInventory:
    """ModelInventory of a GGUF file (or split model): hparams from the metadata, sizes from the header."""
    from .validate import check_hparams, check_metadata, check_tensors
    header = read_header(path)
    spec = spec_from_metadata(header.metadata, {t.name for t in header.tensors})
    hp = spec.hparams
    check_metadata(header.metadata, hp.arch, str(path))
    check_hparams(spec, str(path))
    check_tensors(spec, {t.name: t.shape for t in header.tensors}, str(path),
                  {t.name: t.type_name for t in header.tensors})
    tensors = tuple(make_tensor(hp, t.name, t.shape, t.type_name, t.nbytes) for t in header.tensors)
    name = header.metadata.get("general.name")
    # source: for a split the first shard (header.path), the file llama.cpp is given whichever shard was named here
    source = str(header.path) if len(header.shards) > 1 else str(path)
    return ModelInventory(hp.arch, hp, tensors, name=name if isinstance(name, str) else "", source=source,
                          file_bytes=header.data_bytes)
