"""planner.gguf_header: round trips through synthetic files, an independent reader, split and sparse models,
ik / unknown type ids, hostile headers built with struct.pack, and a fuzz test."""
from __future__ import annotations

import struct
import time
from pathlib import Path

import gguf
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.archs import build_inventory, metadata_for
from planner.errors import GGUFError, InputError, UnknownArchitectureError
from planner.gguf_header import StringArray, load_inventory, read_header
from runtime.synth import TINY, encode_header, tiny_spec, uniform_recipe, write_gguf

ARCHS = list(TINY)
# A type per arch so the round trips cover every writable layout (fallbacks make some tensors Q5_0/Q8_0/F16).
QUANTS = {"llama": ("BF16", None), "qwen3moe": ("Q4_K", None), "qwen2moe": ("Q4_0", None),
          "deepseek2": ("Q6_K", None), "gpt-oss": ("Q8_0", "MXFP4"), "glm4moe": ("Q5_1", "Q5_K"),
          "llama4": ("Q4_1", "F16")}


# ---- hand-built headers (struct.pack) -------------------------------------------------------------------------

def s(text: str | bytes) -> bytes:
    b = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(b)) + b


def kv_u32(key: str, value: int) -> bytes:
    return s(key) + struct.pack("<II", 4, value)


def kv_str(key: str, value: str) -> bytes:
    return s(key) + struct.pack("<I", 8) + s(value)


def kv_strings(key: str, values: list[str]) -> bytes:
    return s(key) + struct.pack("<IIQ", 9, 8, len(values)) + b"".join(s(v) for v in values)


def info(name: str | bytes, shape: tuple[int, ...], type_id: int, offset: int, n_dims: int | None = None) -> bytes:
    n = len(shape) if n_dims is None else n_dims
    return s(name) + struct.pack(f"<I{len(shape)}QIQ", n, *shape, type_id, offset)


def gguf_file(kvs: list[bytes], infos: list[bytes], data: bytes = b"", *, version: int = 3,
              n_tensors: int | None = None, n_kv: int | None = None, alignment: int = 32) -> bytes:
    head = (b"GGUF" + struct.pack("<IQQ", version, len(infos) if n_tensors is None else n_tensors,
                                  len(kvs) if n_kv is None else n_kv) + b"".join(kvs) + b"".join(infos))
    return head + bytes(-len(head) % alignment) + data


# A small valid file: t1 F32 [32, 2] = 256 bytes at 0, t2 Q8_0 [32, 4] = 4 * 34 = 136 bytes at 256 (+24 padding).
VALID_KVS = [kv_str("general.architecture", "llama"), kv_u32("general.alignment", 32),
             kv_strings("tokenizer.ggml.tokens", ["a", "bc", "", "déf"])]
VALID_INFOS = [info("t1", (32, 2), 0, 0), info("t2", (32, 4), 8, 256)]
VALID = gguf_file(VALID_KVS, VALID_INFOS, bytes(256 + 160))


def write(tmp_path: Path, data: bytes, name: str = "f.gguf") -> Path:
    p = tmp_path / name
    p.write_bytes(data)
    return p


def raises_one_line(path: Path, match: str) -> GGUFError:
    with pytest.raises(GGUFError, match=match) as e:
        read_header(path)
    assert "\n" not in str(e.value) and str(path) in str(e.value)
    return e.value


def test_valid_hand_built(tmp_path: Path) -> None:
    h = read_header(write(tmp_path, VALID))
    assert [(t.name, t.shape, t.type_name, t.offset, t.nbytes) for t in h.tensors] == [
        ("t1", (32, 2), "F32", 0, 256), ("t2", (32, 4), "Q8_0", 256, 136)]
    assert h.version == 3 and h.alignment == 32 and h.data_offset % 32 == 0 and h.file_size == len(VALID)
    tokens = h.metadata["tokenizer.ggml.tokens"]
    assert isinstance(tokens, StringArray) and len(tokens) == 4
    assert list(tokens) == ["a", "bc", "", "déf"] and tokens[-1] == "déf" and tokens[1:3] == ["bc", ""]
    assert tokens == ["a", "bc", "", "déf"]
    with pytest.raises(IndexError):
        tokens[4]


# ---- round trips through runtime.synth -------------------------------------------------------------------

@pytest.mark.parametrize("arch", ARCHS)
def test_round_trip_matches_build_inventory(arch: str, tiny_gguf) -> None:
    quant, expert_quant = QUANTS[arch]
    path = tiny_gguf(arch, quant, expert_quant)
    spec, recipe = tiny_spec(arch), uniform_recipe(quant, expert_quant)
    ref = build_inventory(spec, recipe)
    h = read_header(path)
    assert [(t.name, t.shape, t.type_name, t.nbytes) for t in h.tensors] == [
        (t.name, t.shape, t.ggml_type, t.nbytes) for t in ref.tensors]
    assert h.metadata["general.architecture"] == arch
    assert {k: h.metadata[k] for k in metadata_for(spec)} == pytest.approx(metadata_for(spec))
    inv = load_inventory(path)
    assert inv.hparams == ref.hparams and inv.tensors == ref.tensors
    assert inv.source == str(path) and inv.name == "synthetic"
    assert inv.file_bytes == sum(t.nbytes for t in ref.tensors)    # NextN tensors are in the file too


@pytest.mark.parametrize("arch", ARCHS)
def test_independent_reader_agrees(arch: str, tiny_gguf) -> None:
    """gguf-py's GGUFReader (it knows every type synth writes) sees the same names, shapes, types, offsets."""
    path = tiny_gguf(arch, *QUANTS[arch])
    ours, theirs = read_header(path), gguf.GGUFReader(path)
    assert theirs.data_offset == ours.data_offset and theirs.alignment == ours.alignment
    assert [(t.name, t.shape, t.type_id, ours.data_offset + t.offset, t.nbytes) for t in ours.tensors] == [
        (t.name, tuple(int(d) for d in t.shape), int(t.tensor_type), int(t.data_offset), int(t.n_bytes))
        for t in theirs.tensors]
    fields = {f.name: f.contents() for f in theirs.fields.values() if not f.name.startswith("GGUF.")}
    assert fields == ours.metadata


def test_tied_output(tiny_gguf) -> None:
    inv = load_inventory(tiny_gguf("qwen3moe", tied_output=True))
    assert inv.tied_output and "output.weight" not in inv.by_name


# ---- split models -----------------------------------------------------------------------------------------

def _three_shards(tmp_path: Path) -> list[Path]:
    """qwen3moe in 3 shards (sparse: the reader never looks at the data)."""
    spec, recipe = tiny_spec("qwen3moe"), uniform_recipe("Q8_0")
    total = build_inventory(spec, recipe).file_bytes
    for max_bytes in range(total // 3, total, total // 50):    # a shard size that gives 3 shards
        paths = write_gguf(tmp_path / "m.gguf", spec, recipe, split_max_bytes=max_bytes, sparse=True)
        if len(paths) == 3:
            return paths
        for p in paths:
            p.unlink()
    raise AssertionError("no shard size gives 3 shards")


def test_split_reads_as_one(tmp_path: Path) -> None:
    paths = _three_shards(tmp_path)
    assert [p.name for p in paths] == [f"m-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    ref = build_inventory(tiny_spec("qwen3moe"), uniform_recipe("Q8_0"))
    for shard in paths:                                  # shard 1, or a later one: the same model
        h = read_header(shard)
        assert h.path == paths[0] and len(h.shards) == 3
        assert [t.name for t in h.tensors] == [t.name for t in ref.tensors]
        assert sorted({t.shard for t in h.tensors}) == [0, 1, 2]
        assert h.file_size == sum(p.stat().st_size for p in paths)
        inv = load_inventory(shard)
        assert inv.hparams == ref.hparams and inv.tensors == ref.tensors
    h = read_header(paths[0])
    for i, p in enumerate(paths):                       # each shard agrees with gguf-py on its own tensors
        theirs = gguf.GGUFReader(p)
        mine = [t for t in h.tensors if t.shard == i]
        assert [(t.name, h.shards[i].data_offset + t.offset, t.nbytes) for t in mine] == [
            (t.name, int(t.data_offset), int(t.n_bytes)) for t in theirs.tensors]
    assert "general.architecture" not in gguf.GGUFReader(paths[1]).fields     # metadata only in shard 1


def test_split_missing_shard(tmp_path: Path) -> None:
    paths = _three_shards(tmp_path)
    paths[1].unlink()
    raises_one_line(paths[0], r"lacks m-00002-of-00003\.gguf")


def test_split_inconsistent_shard(tmp_path: Path) -> None:
    paths = _three_shards(tmp_path)
    paths[1].write_bytes(paths[2].read_bytes())      # shard 3's content under shard 2's name
    with pytest.raises(GGUFError, match="expected shard 1 of 3"):
        read_header(paths[0])


def test_split_renamed_first_shard(tmp_path: Path) -> None:
    paths = _three_shards(tmp_path)
    raises_one_line(paths[0].rename(tmp_path / "renamed.gguf"), "cannot be found")


def test_sparse_deepseek_v3_size_in_five_shards(tmp_path: Path) -> None:
    """A DeepSeek-V3-shaped model (~352 GiB at Q4_K) as 5 sparse shards: no disk used, sizes exact."""
    spec = tiny_spec("deepseek2", n_layer=61, dense_lead=3, n_embd=7168, n_vocab=129280, n_head=128,
                     head_dim_k=576, head_dim_v=512, n_rot=64, n_ff=18432, n_expert=256, n_expert_used=8,
                     n_ff_exp=2048, q_lora_rank=1536, kv_lora_rank=512, head_dim_k_mla=192, head_dim_v_mla=128)
    recipe = uniform_recipe("Q4_K")
    ref = build_inventory(spec, recipe)
    paths = write_gguf(tmp_path / "ds.gguf", spec, recipe, sparse=True, split_max_bytes=80 << 30)
    assert len(paths) == 5
    assert sum(p.stat().st_blocks for p in paths) * 512 < 64 << 20      # sparse: only headers on disk
    h = read_header(paths[0])
    assert [(t.name, t.nbytes) for t in h.tensors] == [(t.name, t.nbytes) for t in ref.tensors]
    assert h.data_bytes == ref.file_bytes > 350 << 30
    inv = load_inventory(paths[2])
    assert inv.tensors == ref.tensors and inv.hparams == ref.hparams


# ---- ik and unknown type ids --------------------------------------------------------------------------------

def test_ik_and_unknown_type_ids(tmp_path: Path) -> None:
    # IQ4_KS (144): 136 bytes per 256 + 4 bytes of row scale -> 8 rows * 140 = 1120 (a multiple of 32).
    # 250 (an ik repacked id, no table): 40 rows of 146 bytes = 5840, +16 padding -> sized from offsets.
    # 134 (ik's IQ1_BN, no table here): one row of 20 bytes, +12 padding: with fewer rows than the alignment
    #   the span (32) is the best the offsets can say.
    # 158 (ik's IQ1_KT, last): 3 rows of 100 bytes up to the end of the file -> 300.
    infos = [info("a", (256, 8), 144, 0), info("b", (256, 40), 250, 1120), info("d", (10,), 134, 6976),
             info("c", (100, 3), 158, 7008)]
    path = write(tmp_path, gguf_file([kv_str("general.architecture", "llama")], infos, bytes(7008 + 300)))
    h = read_header(path)
    assert [(t.name, t.type_id, t.type_name, t.nbytes) for t in h.tensors] == [
        ("a", 144, "IQ4_KS", 1120), ("b", 250, "IK_R250", 5840), ("d", 134, "TYPE_134", 32),
        ("c", 158, "TYPE_158", 300)]


@pytest.mark.parametrize("type_id", [4, 5, 37, 43, 998])
def test_removed_or_undefined_type_ids_are_refused(type_id: int, tmp_path: Path) -> None:
    # gguf.cpp: type >= GGML_TYPE_COUNT is "invalid ggml type"; removed types (Q4_2 = 4, Q4_3 = 5, IQ4_NL_4_8 =
    # 37) have block size 0 and are refused the same way; ik does not define them either.
    path = write(tmp_path, gguf_file([], [info("t", (32,), type_id, 0)], bytes(64)))
    raises_one_line(path, f"type id {type_id}, which neither llama.cpp nor ik_llama.cpp loads")


def test_gaps_between_tensors_are_refused(tmp_path: Path) -> None:
    # gguf.cpp: tensor i must start where the padded tensors before it end (here 128 + 0 padding), not later.
    infos = [info("a", (32,), 0, 0), info("b", (32,), 0, 160)]
    path = write(tmp_path, gguf_file([], infos, bytes(160 + 128)))
    raises_one_line(path, "'b' has data offset 160, llama.cpp expects 128")


def test_ik_type_larger_than_its_room_is_an_overlap(tmp_path: Path) -> None:
    # IQ4_KS [256, 8] needs 1120 bytes (with row scales); the next tensor starts at 1088.
    infos = [info("a", (256, 8), 144, 0), info("b", (32,), 0, 1088)]
    path = write(tmp_path, gguf_file([], infos, bytes(1088 + 128)))
    raises_one_line(path, "'a' .* overlaps tensor 'b'")


# ---- hostile files ----------------------------------------------------------------------------------------

def _hostile() -> dict[str, tuple[bytes, str]]:
    t1 = [info("t1", (32, 2), 0, 0)]
    data = bytes(256)
    return {
        "empty": (b"", "not a GGUF file"),
        "magic": (b"GGML" + VALID[4:], r"not a GGUF file \(magic b'GGML'\)"),
        "short": (b"GG", "truncated: magic"),
        "version 1": (gguf_file(VALID_KVS, VALID_INFOS, version=1), "unsupported GGUF version 1"),
        "version 4": (gguf_file(VALID_KVS, VALID_INFOS, version=4), "unsupported GGUF version 4"),
        "big-endian": (gguf_file(VALID_KVS, VALID_INFOS, version=3 << 24), "byte-swapped"),
        "tensor count": (gguf_file([], t1, data, n_tensors=1 << 62), "tensor count is .* more than the limit"),
        "tensor count vs file": (gguf_file([], t1, data, n_tensors=60000), "truncated: tensor count"),
        "kv count": (gguf_file(VALID_KVS, t1, data, n_kv=1 << 40), "key-value count .* more than the limit"),
        "key beyond EOF": (b"GGUF" + struct.pack("<IQQQ", 3, 0, 1, 1000) + b"abc" * 9, "truncated: key 0"),
        "string beyond EOF": (gguf_file([s("k") + struct.pack("<IQ", 8, 5000) + b"xy"], []), "truncated: value"),
        "string limit": (gguf_file([s("k") + struct.pack("<IQ", 8, 1 << 62)], []), "more than the limit"),
        "array limit": (gguf_file([s("k") + struct.pack("<IIQ", 9, 4, 1 << 50)], []), "more than the limit"),
        "array beyond EOF": (gguf_file([s("k") + struct.pack("<IIQ", 9, 4, 1000)], []), "truncated"),
        "strings beyond EOF": (gguf_file([s("k") + struct.pack("<IIQ", 9, 8, 3) + s("a") + struct.pack("<Q", 999)],
                                         []), "truncated: .*array 'k'"),
        "nested array": (gguf_file([s("k") + struct.pack("<IIQ", 9, 9, 1)], []), "nested arrays"),
        "value type": (gguf_file([s("k") + struct.pack("<I", 13) + bytes(8)], []), "unknown value type 13"),
        "duplicate key": (gguf_file([kv_u32("k", 1), kv_u32("k", 2)], []), "duplicate key 'k'"),
        "key not utf-8": (gguf_file([s(b"\xff\xfe") + struct.pack("<II", 4, 1)], []), "not UTF-8"),
        "n_dims 9": (gguf_file([], [info("t", (32,) * 9, 0, 0)], data), "9 dimensions"),
        "n_dims 0": (gguf_file([], [info("t", (), 0, 0)], data), "0 dimensions"),
        "zero dim": (gguf_file([], [info("t", (32, 0), 0, 0)], data), r"dimension 0 in shape \[32, 0\]"),
        "elements": (gguf_file([], [info("t", (1 << 40, 1 << 40), 0, 0)], data), "more than 2\\^63 elements"),
        "block": (gguf_file([], [info("t", (33, 2), 8, 0)], data), "not a multiple of Q8_0's block of 32"),
        "type id": (gguf_file([], [info("t", (32,), 1 << 31, 0)], data), "type id 2147483648"),
        "long name": (gguf_file([], [info("x" * 100, (32,), 0, 0)], data), "longer than 63 bytes"),
        "duplicate tensor": (gguf_file([], t1 * 2, data), "duplicate tensor name 't1'"),
        "offset beyond EOF": (gguf_file([], [info("t1", (32, 2), 0, 1 << 20)], data), "beyond the end of the file"),
        "data truncated": (gguf_file([], t1, bytes(100)), "truncated: tensor 't1' needs 256 bytes"),
        "no data section": (gguf_file([], t1)[:-1], "truncated"),
        "unaligned offset": (gguf_file([], [info("t1", (32,), 0, 8)], data), "not a multiple of the alignment"),
        "overlap": (gguf_file([], t1 + [info("t2", (32,), 0, 128)], data), "overlaps tensor 't2'"),
        "alignment 48": (gguf_file([kv_u32("general.alignment", 48)], t1, data), "alignment 48 is not a power of two"),
        "alignment 0": (gguf_file([kv_u32("general.alignment", 0)], t1, data), "alignment 0 is not"),
        "alignment type": (gguf_file([s("general.alignment") + struct.pack("<IQ", 10, 32)], t1, data),
                           "llama.cpp needs uint32"),
    }


@pytest.mark.parametrize("case", list(_hostile()))
def test_hostile_file_raises_one_line(case: str, tmp_path: Path) -> None:
    data, match = _hostile()[case]
    raises_one_line(write(tmp_path, data), match)


def test_every_truncation_of_a_valid_file(tmp_path: Path) -> None:
    """Cut anywhere before the end of the last tensor's data: GGUFError. Cut in its trailing padding: valid
    (llama.cpp only needs offset + nbytes inside the file)."""
    data_offset = read_header(write(tmp_path, VALID)).data_offset
    end_of_data = data_offset + 256 + 136
    for cut in range(len(VALID)):
        path = write(tmp_path, VALID[:cut])
        if cut < end_of_data:
            with pytest.raises(GGUFError):
                read_header(path)
        else:
            assert read_header(path).tensors[1].nbytes == 136


def test_missing_file_and_directory(tmp_path: Path) -> None:
    raises_one_line(tmp_path / "nope.gguf", "cannot read")
    raises_one_line(tmp_path, "cannot read")


def test_load_inventory_errors(tmp_path: Path) -> None:
    path = write(tmp_path, gguf_file([kv_str("general.architecture", "mamba")], []))
    with pytest.raises(UnknownArchitectureError, match="mamba"):
        load_inventory(path)
    path = write(tmp_path, gguf_file([kv_str("general.architecture", "llama"), kv_str("llama.block_count", "x"),
                                      kv_u32("llama.embedding_length", 64)], []))
    with pytest.raises(GGUFError, match="llama.block_count is 'x'"):
        load_inventory(path)


def test_header_speed_deepseek_v3_size(tmp_path: Path) -> None:
    """1,086 tensor infos and 129k-token tokenizer arrays: typically ~0.04 s here (bound kept loose for CI)."""
    spec = tiny_spec("deepseek2", n_layer=61, dense_lead=3, n_embd=7168, n_vocab=129280, n_head=128,
                     head_dim_k=576, head_dim_v=512, n_rot=64, n_ff=18432, n_expert=256, n_expert_used=8,
                     n_ff_exp=2048, q_lora_rank=1536, kv_lora_rank=512, head_dim_k_mla=192, head_dim_v_mla=128)
    ref = build_inventory(spec, uniform_recipe("Q4_K"))
    infos, offset = [], 0
    for t in ref.tensors:
        infos.append((t.name, t.shape, gguf.GGMLQuantizationType[t.ggml_type].value, offset))
        offset += t.nbytes + (-t.nbytes % 32)
    meta = {"general.architecture": "deepseek2", **metadata_for(spec), "tokenizer.ggml.model": "gpt2",
            "tokenizer.ggml.tokens": [f"t{i}" for i in range(129280)],
            "tokenizer.ggml.token_type": [1] * 129280,
            "tokenizer.ggml.merges": [f"a{i} b" for i in range(127741)]}
    del meta["deepseek2.vocab_size"]                     # n_vocab from len(tokens), as llama.cpp does
    path = tmp_path / "ds.gguf"
    with open(path, "wb") as f:
        f.write(encode_header(meta, infos))
        f.truncate(f.tell() + offset)
    start = time.perf_counter()
    h = read_header(path)
    elapsed = time.perf_counter() - start
    assert len(h.tensors) == 1086 and len(h.metadata["tokenizer.ggml.tokens"]) == 129280
    assert h.metadata["tokenizer.ggml.tokens"][129279] == "t129279"
    assert load_inventory(path).hparams == ref.hparams
    assert elapsed < 0.5


# ---- fuzz ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fuzz_seeds(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[bytes], Path]:
    """The hand-built VALID file and a whole synthetic gpt-oss small enough to rewrite per example (~70 KB)."""
    folder = tmp_path_factory.mktemp("fuzz")
    spec = tiny_spec("gpt-oss", n_embd=64, n_vocab=64, n_head=2, n_head_kv=1, head_dim_k=32, head_dim_v=32,
                     n_rot=32, n_expert=4, n_ff_exp=32)
    path = write_gguf(folder / "seed.gguf", spec, uniform_recipe("Q8_0", "MXFP4"))[0]
    return [VALID, path.read_bytes()], folder


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(which=st.integers(0, 1),
       edits=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 255)), max_size=8),
       cut=st.none() | st.floats(0, 1),
       insert=st.none() | st.tuples(st.floats(0, 1), st.binary(min_size=1, max_size=16)))
def test_fuzz_only_gguf_errors(fuzz_seeds, which: int, edits, cut, insert) -> None:
    seeds, folder = fuzz_seeds
    data = bytearray(seeds[which])
    for where, byte in edits:
        data[int(where * len(data))] = byte
    if insert is not None:
        at = int(insert[0] * len(data))
        data[at:at] = insert[1]
    if cut is not None:
        del data[int(cut * len(data)):]
    path = folder / "fuzzed.gguf"
    path.write_bytes(bytes(data))
    try:
        read_header(path)
    except GGUFError as e:
        assert "\n" not in str(e)
    try:
        load_inventory(path)
    except InputError as e:      # GGUFError or UnknownArchitectureError
        assert "\n" not in str(e)


def test_fuzz_seed_files_are_valid(fuzz_seeds) -> None:
    seeds, folder = fuzz_seeds
    for i, data in enumerate(seeds):
        path = folder / f"seed{i}.gguf"
        path.write_bytes(data)
        assert read_header(path).tensors
    assert load_inventory(path).arch == "gpt-oss"
