"""Mutated GGUF files for the fuzz and loader-agreement tests (and the acceptance run in
benchmarks/fuzz_acceptance.py): byte flips, truncations, absurd counts, renamed / dropped / duplicated / extra
tensors, reshaped tensors, unknown and removed type ids, dropped and changed keys, gaps between tensors, missing
shards, and the fused variants llama.cpp loads (attn_qkv, ffn_gate_up_exps).

A file is kept as its parts (`Raw`: each key-value pair as its encoded bytes, so a value keeps its GGUF type;
tensors with their data) and written back with contiguous offsets unless a mutation says otherwise.
"""
from __future__ import annotations

import random
import struct
from dataclasses import dataclass, field, replace
from pathlib import Path
from collections.abc import Callable

from planner.gguf_header import read_header
from runtime.synth import tiny_spec, uniform_recipe, write_gguf

_SCALAR_SIZE = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_SCALAR_FMT = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


@dataclass
class Raw:
    version: int
    kvs: list[tuple[str, bytes]]                            # key, its whole encoded entry
    tensors: list[tuple[str, tuple[int, ...], int, bytes]]  # name, shape, type id, data
    alignment: int = 32
    gaps: dict[int, int] = field(default_factory=dict)      # tensor index -> extra bytes before its data
    n_tensors_delta: int = 0                                # declared tensor count minus the real one
    order: list[int] | None = None                          # order of the data (None: the header order)

    def copy(self) -> Raw:
        return replace(self, kvs=list(self.kvs), tensors=list(self.tensors), gaps=dict(self.gaps))


def _s(b: bytes) -> bytes:
    return struct.pack("<Q", len(b)) + b


def _skip_value(buf: bytes, pos: int, vtype: int) -> int:
    if vtype in _SCALAR_SIZE:
        return pos + _SCALAR_SIZE[vtype]
    if vtype == 8:
        return pos + 8 + struct.unpack_from("<Q", buf, pos)[0]
    etype, n = struct.unpack_from("<IQ", buf, pos)
    pos += 12
    if etype == 8:
        for _ in range(n):
            pos += 8 + struct.unpack_from("<Q", buf, pos)[0]
        return pos
    return pos + n * _SCALAR_SIZE[etype]


def parse(path: Path) -> Raw:
    """The parts of a valid file (read with the project's reader, key spans walked here)."""
    h = read_header(path)
    buf = path.read_bytes()
    version, _, n_kv = struct.unpack_from("<IQQ", buf, 4)
    pos, kvs = 24, []
    for _ in range(n_kv):
        start = pos
        klen = struct.unpack_from("<Q", buf, pos)[0]
        key = buf[pos + 8:pos + 8 + klen].decode()
        pos += 8 + klen
        vtype = struct.unpack_from("<I", buf, pos)[0]
        pos = _skip_value(buf, pos + 4, vtype)
        kvs.append((key, buf[start:pos]))
    tensors = [(t.name, t.shape, t.type_id, buf[h.data_offset + t.offset:h.data_offset + t.offset + t.nbytes])
               for t in h.tensors]
    return Raw(version, kvs, tensors, h.alignment)


def encode(raw: Raw) -> bytes:
    offsets, data, off = {}, bytearray(), 0
    for i in raw.order or range(len(raw.tensors)):
        off += raw.gaps.get(i, 0)
        data += bytes(off - len(data))
        offsets[i] = off
        data += raw.tensors[i][3]
        off = len(data) + (-len(data)) % raw.alignment
    data += bytes(off - len(data))
    infos = [_s(name.encode()) + struct.pack(f"<I{len(shape)}QIQ", len(shape), *shape, type_id, offsets[i])
             for i, (name, shape, type_id, _) in enumerate(raw.tensors)]
    head = b"GGUF" + struct.pack("<IQQ", raw.version, len(raw.tensors) + raw.n_tensors_delta, len(raw.kvs))
    head += b"".join(e for _, e in raw.kvs) + b"".join(infos)
    return head + bytes(-len(head) % raw.alignment) + bytes(data)


def kv_value(raw: Raw, key: str) -> tuple[int, object] | None:
    for k, e in raw.kvs:
        if k == key:
            pos = 8 + len(k.encode())
            vtype = struct.unpack_from("<I", e, pos)[0]
            if vtype in _SCALAR_FMT:
                return vtype, struct.unpack_from(_SCALAR_FMT[vtype], e, pos + 4)[0]
            if vtype == 8:
                n = struct.unpack_from("<Q", e, pos + 4)[0]
                return vtype, e[pos + 12:pos + 12 + n].decode("utf-8", "replace")
            return vtype, None
    return None


def set_kv(raw: Raw, key: str, value: object) -> bool:
    """Give `key` a new value of its own GGUF type; False when the key is not a scalar or string there."""
    got = kv_value(raw, key)
    if got is None or got[1] is None:
        return False
    vtype = got[0]
    body = _s(str(value).encode()) if vtype == 8 else struct.pack(_SCALAR_FMT[vtype], value)
    entry = _s(key.encode()) + struct.pack("<I", vtype) + body
    raw.kvs = [(k, entry if k == key else e) for k, e in raw.kvs]
    return True


# ---- the seed files --------------------------------------------------------------------------------------

def commands(path: Path) -> list[list[str]]:
    """What every fuzzed file goes through: inspect, explain with a typical -ot, plan."""
    return [["inspect", str(path), "--json"],
            ["explain", str(path), "--json", "--", "-ngl", "99", "-ot", "exps=CPU"],
            ["plan", str(path), "--gpu", "1GiB", "--keep-free", "0", "--json", "--top", "2"]]


SEED_ARCHS = ("qwen3moe", "gpt-oss", "deepseek2", "glm4moe", "qwen2moe", "llama")


def make_seeds(folder: Path) -> dict[str, Path]:
    """One small valid file per architecture (Q8_0; gpt-oss experts MXFP4), plus a 4-shard deepseek2 split."""
    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    for arch in SEED_ARCHS:
        expert = "MXFP4" if arch == "gpt-oss" else None
        out[arch] = write_gguf(folder / f"{arch}.gguf", tiny_spec(arch), uniform_recipe("Q8_0", expert))[0]
    (folder / "split").mkdir(exist_ok=True)
    out["split"] = write_gguf(folder / "split" / "ds.gguf", tiny_spec("deepseek2"), uniform_recipe("Q8_0"),
                              split_max_bytes=1 << 20)[0]
    return out


# ---- mutations: Raw -> (Raw, label), or bytes -> bytes ------------------------------------------------------

def _layer_names(raw: Raw, suffix: str) -> list[int]:
    return [i for i, (n, *_) in enumerate(raw.tensors) if n.endswith(suffix)]


def m_drop_tensor(raw: Raw, rng: random.Random) -> str:
    i = rng.randrange(len(raw.tensors))
    name = raw.tensors.pop(i)[0]
    return f"drop tensor {name}"


def m_rename_tensor(raw: Raw, rng: random.Random) -> str:
    i = rng.randrange(len(raw.tensors))
    name, shape, t, blob = raw.tensors[i]
    parts = name.split(".")
    choice = rng.randrange(4)
    if choice == 0 and parts[0] == "blk":
        new = ".".join(["blk", str(rng.choice([999, 64, int(parts[1]) + 1]))] + parts[2:])
    elif choice == 1:
        new = name.replace("weight", "wieght")
    elif choice == 2:
        new = rng.choice(raw.tensors)[0]          # becomes a duplicate of another name
    else:
        new = name[:-1] + chr(rng.randrange(97, 123))
    raw.tensors[i] = (new, shape, t, blob)
    return f"rename {name} -> {new}"


def m_duplicate_tensor(raw: Raw, rng: random.Random) -> str:
    i = rng.randrange(len(raw.tensors))
    raw.tensors.insert(rng.randrange(len(raw.tensors) + 1), raw.tensors[i])
    return f"duplicate {raw.tensors[i][0]}"


def m_extra_tensor(raw: Raw, rng: random.Random) -> str:
    """A tensor llama.cpp may or may not create: an optional bias of the right shape, a wrong one, a layer past
    block_count."""
    q = next((x for x in raw.tensors if x[0].endswith("attn_q.weight")), None)
    layer = q[0].split(".")[1] if q else "0"
    n_layer = 1 + max(int(n.split(".")[1]) for n, *_ in raw.tensors if n.startswith("blk."))
    kind = rng.randrange(3)
    if kind == 0 and q is not None:
        name, shape = f"blk.{layer}.attn_q.bias", (q[1][1],)
    elif kind == 1:
        name, shape = f"blk.{layer}.attn_q.bias", (rng.choice([7, 64, 1000]),)
    else:
        name, shape = f"blk.{n_layer}.attn_norm.weight", (raw.tensors[0][1][0],)
    if any(n == name for n, *_ in raw.tensors):
        name = f"blk.{n_layer}.ffn_norm.weight"
    n = 1
    for d in shape:
        n *= d
    raw.tensors.insert(rng.randrange(len(raw.tensors) + 1), (name, shape, 0, bytes(4 * n)))
    return f"extra tensor {name} {list(shape)}"


def _nbytes(shape: tuple[int, ...], type_id: int) -> int | None:
    from planner.ggml_types import BY_ID
    t = BY_ID.get(type_id)
    if t is None or shape[0] % t.block:
        return None
    return t.nbytes(shape)


def m_reshape_tensor(raw: Raw, rng: random.Random) -> str:
    i = rng.randrange(len(raw.tensors))
    name, shape, t, blob = raw.tensors[i]
    if len(shape) >= 2 and shape[0] != shape[1] and _nbytes((shape[1], shape[0], *shape[2:]), t):
        new = (shape[1], shape[0], *shape[2:])
    else:
        new = (*shape, 1) if len(shape) < 4 else shape[:-1]
    size = _nbytes(new, t)
    if size is None:
        new = shape
        size = len(blob)
    raw.tensors[i] = (name, new, t, (blob + bytes(size))[:size])
    return f"reshape {name} {list(shape)} -> {list(new)}"


def m_retype_tensor(raw: Raw, rng: random.Random) -> str:
    """Another type id: removed or undefined (refused), another mainline type (loads), an ik type."""
    i = rng.randrange(len(raw.tensors))
    name, shape, t, blob = raw.tensors[i]
    new = rng.choice([4, 5, 37, 43, 100, 1000, 0, 1, 30, 8, 139, 144])
    size = _nbytes(shape, new)
    if size is None:
        size = len(blob)
    raw.tensors[i] = (name, shape, new, (blob + bytes(size))[:size])
    return f"retype {name} {t} -> {new}"


def m_drop_key(raw: Raw, rng: random.Random) -> str:
    i = rng.randrange(len(raw.kvs))
    return f"drop key {raw.kvs.pop(i)[0]}"


_KEY_EDITS = ("block_count", "expert_used_count", "expert_count", "embedding_length", "attention.head_count",
              "attention.head_count_kv", "context_length", "vocab_size", "feed_forward_length",
              "expert_feed_forward_length", "attention.key_length", "rope.dimension_count",
              "leading_dense_block_count", "attention.kv_lora_rank", "nextn_predict_layers")


def m_change_key(raw: Raw, rng: random.Random) -> str:
    arch = kv_value(raw, "general.architecture")
    arch = arch[1] if arch else "llama"
    for _ in range(20):
        key = f"{arch}.{rng.choice(_KEY_EDITS)}"
        got = kv_value(raw, key)
        if got is None or not isinstance(got[1], int) or isinstance(got[1], bool):
            continue
        value = got[1]
        new = rng.choice([0, 1, value + 1, max(value - 1, 0), value * 2, 2**31 - 1, 100000])
        if new != value and set_kv(raw, key, new):
            return f"{key} {value} -> {new}"
    if set_kv(raw, "tokenizer.ggml.model", rng.choice(["gpt3", "bogus", "llama2"])):
        return "tokenizer.ggml.model -> unknown"
    return "no change"


def m_gap(raw: Raw, rng: random.Random) -> str:
    i = rng.randrange(len(raw.tensors))
    raw.gaps[i] = raw.alignment * rng.randrange(1, 4)
    return f"gap before {raw.tensors[i][0]}"


def m_swap_data(raw: Raw, rng: random.Random) -> str:
    """Two tensors' data in the other order than their infos: llama.cpp refuses (data must follow the header)."""
    i = rng.randrange(len(raw.tensors) - 1)
    order = list(range(len(raw.tensors)))
    order[i], order[i + 1] = i + 1, i
    raw.order = order
    return f"data of {raw.tensors[i][0]} and {raw.tensors[i + 1][0]} swapped"


def m_fuse_qkv(raw: Raw, rng: random.Random) -> str:
    """attn_q/k/v.weight -> attn_qkv.weight (rows concatenated) in every layer: llama.cpp loads it."""
    by = {n: (s, t, b) for n, s, t, b in raw.tensors}
    fused: dict[str, tuple[str, tuple[int, ...], int, bytes]] = {}
    for n, (s, t, b) in by.items():
        k, v = n.replace("attn_q.", "attn_k."), n.replace("attn_q.", "attn_v.")
        if n.endswith("attn_q.weight") and k in by and v in by and by[k][1] == t == by[v][1]:
            fused[n] = (n.replace("attn_q.", "attn_qkv."), (s[0], s[1] + by[k][0][1] + by[v][0][1]), t,
                        b + by[k][2] + by[v][2])
    gone = {n.replace("attn_q.", f"attn_{x}.") for n in fused for x in "kv"}
    raw.tensors = [fused.get(x[0], x) for x in raw.tensors if x[0] not in gone]
    return f"fused qkv in {len(fused)} layers"


def m_fuse_gate_up(raw: Raw, rng: random.Random) -> str:
    """ffn_gate_exps + ffn_up_exps -> ffn_gate_up_exps (per expert: gate rows, then up rows)."""
    by = {n: (s, t, b) for n, s, t, b in raw.tensors}
    out, fused = [], set()
    for n, s, t, b in raw.tensors:
        if n.endswith("ffn_gate_exps.weight") and n.replace("gate", "up") in by:
            us, ut, ub = by[n.replace("gate", "up")]
            if ut == t and us == s:
                x = s[2]
                step = len(b) // x
                blob = b"".join(b[e * step:(e + 1) * step] + ub[e * step:(e + 1) * step] for e in range(x))
                out.append((n.replace("gate_exps", "gate_up_exps"), (s[0], 2 * s[1], x), t, blob))
                fused.add(n.replace("gate", "up"))
                continue
        if n in fused:
            continue
        out.append((n, s, t, b))
    raw.tensors = [x for x in out if x[0] not in fused]
    return f"fused gate_up in {len(fused)} layers"


def m_count(raw: Raw, rng: random.Random) -> str:
    raw.n_tensors_delta = rng.choice([1, -1, 1 << 40])
    return f"tensor count off by {raw.n_tensors_delta}"


STRUCTURAL: dict[str, Callable[[Raw, random.Random], str]] = {
    "drop_tensor": m_drop_tensor, "rename_tensor": m_rename_tensor, "duplicate_tensor": m_duplicate_tensor,
    "extra_tensor": m_extra_tensor, "reshape_tensor": m_reshape_tensor, "retype_tensor": m_retype_tensor,
    "drop_key": m_drop_key, "change_key": m_change_key, "gap": m_gap, "swap_data": m_swap_data,
    "fuse_qkv": m_fuse_qkv, "fuse_gate_up": m_fuse_gate_up, "count": m_count,
}


def b_flip(data: bytes, rng: random.Random) -> tuple[bytes, str]:
    """Flip bytes in the header (where every count, length, key and shape lives)."""
    b = bytearray(data)
    head = min(len(b), 4096)
    n = rng.choice([1, 2, 4, 16])
    for _ in range(n):
        i = rng.randrange(head)
        b[i] = rng.randrange(256)
    return bytes(b), f"{n} byte(s) changed"


def b_truncate(data: bytes, rng: random.Random) -> tuple[bytes, str]:
    cut = rng.choice([rng.randrange(len(data)), rng.randrange(min(len(data), 4096))])
    return data[:cut], f"truncated at {cut}"


def b_absurd(data: bytes, rng: random.Random) -> tuple[bytes, str]:
    """An absurd 64-bit count or length at a random 8-byte-aligned spot of the header."""
    b = bytearray(data)
    i = rng.choice([8, 16]) if rng.random() < 0.3 else rng.randrange(0, min(len(b), 4096) - 8)
    b[i:i + 8] = struct.pack("<Q", rng.choice([2**63 - 1, 2**40, 2**32 + 1, 0xFFFFFFFFFFFFFFFF]))
    return bytes(b), f"absurd u64 at {i}"


BYTES: dict[str, Callable[[bytes, random.Random], tuple[bytes, str]]] = {
    "flip": b_flip, "truncate": b_truncate, "absurd": b_absurd,
}


def corpus(seeds: dict[str, Path], out: Path, n: int, seed: int, kinds: tuple[str, ...] | None = None,
           archs: tuple[str, ...] | None = None) -> list[tuple[Path, str]]:
    """n mutated files under `out`: (path, what was done). Split-model cases drop or damage a shard."""
    rng = random.Random(seed)
    out.mkdir(parents=True, exist_ok=True)
    names = list(kinds or (tuple(STRUCTURAL) + tuple(BYTES) + ("missing_shard",)))
    pool = [a for a in (archs or tuple(seeds)) if a in seeds]
    raws = {a: parse(p) for a, p in seeds.items() if a != "split"}
    files = []
    for i in range(n):
        kind = rng.choice(names)
        arch = rng.choice(pool)
        if arch == "split" or kind == "missing_shard":
            files.append(_split_case(seeds["split"], out / f"{i:04d}", rng, kind))
            continue
        path = out / f"{i:04d}-{arch}-{kind}.gguf"
        if kind in BYTES:
            data, label = BYTES[kind](seeds[arch].read_bytes(), rng)
        else:
            raw = raws[arch].copy()
            label = STRUCTURAL[kind](raw, rng)
            data = encode(raw)
        path.write_bytes(data)
        files.append((path, f"{arch} {kind}: {label}"))
    return files


def _split_case(first: Path, folder: Path, rng: random.Random, kind: str) -> tuple[Path, str]:
    folder.mkdir(parents=True, exist_ok=True)
    shards = sorted(first.parent.glob(first.name.replace("00001", "*")))
    for s in shards:
        (folder / s.name).write_bytes(s.read_bytes())
    victim = folder / rng.choice(shards).name
    if kind == "missing_shard" or rng.random() < 0.3:
        victim.unlink()
        return folder / first.name, f"split: {victim.name} missing"
    op = rng.choice(list(BYTES))
    data, label = BYTES[op](victim.read_bytes(), rng)
    victim.write_bytes(data)
    return folder / first.name, f"split: {victim.name} {op}: {label}"
