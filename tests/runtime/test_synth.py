"""runtime.synth: tiny specs, recipes, data that dequantizes to sane weights, splits, sparse files, the
`synth` command, and (marked llamacpp) the real llama-bench loading a tiny model of every arch."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf.quants import dequantize

from planner.archs import build_inventory, metadata_for, spec_from_metadata, tensor_shapes
from planner.errors import InputError, UnknownArchitectureError
from planner.gguf_header import load_inventory, read_header
from runtime.synth import (BLOCK_SCALES, FLOAT_TYPES, TINY, _RandomData, synth, tiny_spec, uniform_recipe,
                           write_gguf)

# A type mix per arch for the llama-bench run, so llama.cpp computes with every block layout synth writes.
BENCH_QUANTS = {"qwen3moe": ("Q4_K", None), "qwen2moe": ("Q4_0", "Q2_K"), "deepseek2": ("Q6_K", "Q3_K"),
                "gpt-oss": ("Q8_0", "MXFP4"), "glm4moe": ("Q5_1", "Q5_K"), "llama4": ("IQ4_NL", "IQ4_XS"),
                "llama": ("BF16", None)}


@pytest.mark.parametrize("arch", list(TINY))
def test_tiny_spec_survives_its_own_metadata(arch: str) -> None:
    """What a file of tiny_spec says is read back as the same spec (so file and spec inventories agree)."""
    spec = tiny_spec(arch)
    meta = {"general.architecture": arch, **metadata_for(spec)}
    assert spec_from_metadata(meta, {name for name, _ in tensor_shapes(spec)}) == spec
    assert build_inventory(spec, uniform_recipe("Q8_0")).total_bytes() < 8 << 20


def test_tiny_spec_layouts() -> None:
    ds = tiny_spec("deepseek2")
    assert ds.hparams.moe_layers == (False, True, True) and ds.hparams.is_mla and ds.q_lora_rank == 256
    assert tiny_spec("gpt-oss").hparams.swa_layers == (True, False)
    assert tiny_spec("llama4").hparams.moe_layers == (False, True, False, True)
    glm = tiny_spec("glm4moe").hparams
    assert glm.n_nextn == 1 and glm.moe_layers == (False, True, True) and glm.swa_layers == (False,) * 3
    assert tiny_spec("qwen3moe", n_layer=5).hparams.n_head_kv == (2,) * 5
    with pytest.raises(InputError, match="unknown tiny_spec keys"):
        tiny_spec("llama", n_layers=3)
    with pytest.raises(InputError, match="no tiny model"):
        tiny_spec("mamba")


def test_uniform_recipe() -> None:
    t = uniform_recipe("Q4_K", expert_type="MXFP4")
    assert t("blk.0.attn_norm.weight", (256,), 0) == "F32"
    assert t("blk.0.ffn_gate_inp.weight", (256, 8), 0) == "F32"            # routers stay F32
    assert t("blk.0.ffn_gate_exps.bias", (256, 8), 0) == "F32"             # so do gpt-oss's 2-D biases
    assert t("blk.0.ffn_up_exps.weight", (256, 256, 8), 0) == "MXFP4"
    assert t("blk.0.attn_q.weight", (256, 256), 0) == "Q4_K"
    assert t("blk.0.attn_k_b.weight", (64, 256, 4), 0) == "Q5_0"           # llama-quant.cpp fallback
    assert uniform_recipe("Q6_K")("x.weight", (96, 2), 0) == "Q8_0"
    assert uniform_recipe("Q4_K")("x.weight", (48, 2), 0) == "F16"          # Q5_0 does not fit either
    with pytest.raises(InputError, match="unknown ggml type"):
        uniform_recipe("Q9_9")


@pytest.mark.parametrize("ggml_type", list(BLOCK_SCALES) + list(FLOAT_TYPES))
def test_random_blocks_dequantize_to_small_finite_weights(ggml_type: str) -> None:
    """gguf-py's reference dequantizer sees weights like an initialised model's: finite, std ~0.02."""
    pool = np.frombuffer(_RandomData(seed=1).pool(ggml_type), dtype=np.uint8)
    qtype = gguf.GGMLQuantizationType[ggml_type]
    _, type_bytes = gguf.GGML_QUANT_SIZES[qtype]
    weights = dequantize(pool[: len(pool) // type_bytes * type_bytes].reshape(1, -1), qtype)
    assert np.isfinite(weights).all()
    assert 0.01 < float(weights.std()) < 0.05 and abs(float(weights.mean())) < 0.005


def test_norms_one_biases_zero(tiny_gguf) -> None:
    path = tiny_gguf("gpt-oss")
    h, reader = read_header(path), gguf.GGUFReader(path)
    data = {t.name: np.asarray(t.data) for t in reader.tensors}
    assert abs(float(data["blk.0.attn_norm.weight"].mean()) - 1.0) < 0.01
    assert not data["blk.0.ffn_gate_exps.bias"].any() and not data["blk.1.attn_q.bias"].any()
    size = h.data_offset + sum(t.nbytes + (-t.nbytes % 32) for t in h.tensors)
    assert path.stat().st_size == size


def test_seed_changes_data_not_layout(tmp_path: Path) -> None:
    spec, recipe = tiny_spec("llama"), uniform_recipe("Q8_0")
    a = write_gguf(tmp_path / "a.gguf", spec, recipe, seed=1)[0].read_bytes()
    b = write_gguf(tmp_path / "b.gguf", spec, recipe, seed=2)[0].read_bytes()
    c = write_gguf(tmp_path / "c.gguf", spec, recipe, seed=1)[0].read_bytes()
    assert len(a) == len(b) and a != b and a == c


def test_split_like_gguf_split(tmp_path: Path) -> None:
    spec, recipe = tiny_spec("glm4moe"), uniform_recipe("Q8_0")
    paths = write_gguf(tmp_path / "g.gguf", spec, recipe, split_max_bytes=1 << 20)
    n = len(paths)
    assert n > 1 and [p.name for p in paths] == [f"g-{i:05d}-of-{n:05d}.gguf" for i in range(1, n + 1)]
    for i, p in enumerate(paths):
        fields = gguf.GGUFReader(p).fields
        # key types as gguf-split writes them and llama-model-loader.cpp reads them
        assert fields["split.no"].types == [gguf.GGUFValueType.UINT16] and fields["split.no"].contents() == i
        assert fields["split.count"].types == [gguf.GGUFValueType.UINT16] and fields["split.count"].contents() == n
        assert fields["split.tensors.count"].types == [gguf.GGUFValueType.INT32]
        assert ("general.architecture" in fields) == (i == 0)
        assert p.stat().st_size <= (1 << 20) + 64 * 1024       # data at most split_max, plus the header
    assert load_inventory(paths[0]).tensors == build_inventory(spec, recipe).tensors


def test_sparse_uses_no_disk(tmp_path: Path) -> None:
    spec = tiny_spec("qwen3moe", n_layer=48, n_embd=2048, n_expert=128, n_expert_used=8, n_ff_exp=768,
                     n_head=32, n_head_kv=4, head_dim_k=128, head_dim_v=128, n_rot=128, n_vocab=151936)
    path = write_gguf(tmp_path / "q.gguf", spec, uniform_recipe("Q4_K"), sparse=True)[0]
    assert path.stat().st_size > 15 << 30 and path.stat().st_blocks * 512 < 16 << 20
    assert read_header(path).data_bytes == build_inventory(spec, uniform_recipe("Q4_K")).file_bytes


def test_write_errors(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="synth cannot write .* as IQ2_XXS"):
        write_gguf(tmp_path / "x.gguf", tiny_spec("llama"), uniform_recipe("IQ2_XXS"))
    with pytest.raises(InputError, match="attn_k_b.weight: row of 64 elements does not fit Q4_K's block"):
        write_gguf(tmp_path / "x.gguf", tiny_spec("deepseek2"), lambda name, shape, layer: "Q4_K"
                   if len(shape) > 1 else "F32")


# ---- `offload-tuner synth` -------------------------------------------------------------------------------

def test_synth_tiny(tmp_path: Path) -> None:
    out = tmp_path / "t.gguf"
    assert synth(str(out), arch="deepseek2", tiny=True, quant="Q4_K") == [out]
    inv = load_inventory(out)
    assert inv.name == "tiny-deepseek2-Q4_K"
    assert inv.tensors == build_inventory(tiny_spec("deepseek2"), uniform_recipe("Q4_K")).tensors


def test_synth_split_and_errors(tmp_path: Path) -> None:
    pytest.importorskip("planner.hardware")
    out = tmp_path / "s.gguf"
    paths = synth(str(out), arch="qwen3moe", tiny=True, split_max="1MiB", sparse=True)
    assert len(paths) > 1 and paths[0].name == f"s-00001-of-{len(paths):05d}.gguf"
    for kw, match in [(dict(arch="qwen3moe"), "--arch ARCH --tiny"), ({}, "synth needs --preset"),
                      (dict(preset="Qwen3-30B-A3B", arch="llama", tiny=True), "not both"),
                      (dict(preset="Qwen3-30B-A3B", quant="Q4_0"), "--quant is for --tiny")]:
        with pytest.raises(InputError, match=match):
            synth(str(out), **kw)
    with pytest.raises(UnknownArchitectureError):
        synth(str(out), arch="mamba", tiny=True)


def test_offload_tuner_synth_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Through offload_tuner.cli's own parser: a file, and an error as one line with exit status 2."""
    cli = pytest.importorskip("offload_tuner.cli")
    out = tmp_path / "c.gguf"
    assert cli.main(["synth", "--arch", "llama4", "--tiny", "--out", str(out), "--seed", "3"]) == 0
    assert capsys.readouterr().out.split() == [str(out)]
    assert load_inventory(out).tensors == build_inventory(tiny_spec("llama4"), uniform_recipe("Q8_0")).tensors
    assert cli.main(["synth", "--arch", "llama4", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--tiny" in err


def test_synth_preset_sparse(tmp_path: Path) -> None:
    """A preset written as a sparse file reads back as the preset's own inventory."""
    presets = pytest.importorskip("planner.presets")
    out = tmp_path / "p.gguf"
    synth(str(out), preset="Qwen3-30B-A3B:Q4_K_M", sparse=True)
    assert load_inventory(out).tensors == presets.load_preset("Qwen3-30B-A3B:Q4_K_M").inventory().tensors


# ---- the real llama.cpp -------------------------------------------------------------------------------------

def _bench(llama_bench: Path, model: Path) -> list[dict]:
    cmd = [str(llama_bench), "-m", str(model), "-p", "8", "-n", "2", "-r", "1", "-o", "json"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{' '.join(cmd)} failed:\n{r.stderr[-2000:]}"
    return json.loads(r.stdout)


@pytest.mark.llamacpp                 # llama: > 3 s on 2 cores, so slow
@pytest.mark.parametrize("arch", [pytest.param(a, marks=pytest.mark.slow) if a == "llama" else a for a in TINY])
def test_llama_bench_loads_tiny_model(arch: str, tiny_gguf, llama_bench: Path) -> None:
    path = tiny_gguf(arch, *BENCH_QUANTS[arch])
    rows = _bench(llama_bench, path)
    assert [(r["n_prompt"], r["n_gen"]) for r in rows] == [(8, 0), (0, 2)]
    assert all(r["avg_ts"] > 0 and r["model_type"].startswith(arch) for r in rows)
    # llama-bench's model_size is every tensor in the file (llama-model-loader's n_bytes), NextN ones included
    assert rows[0]["model_size"] == read_header(path).data_bytes


@pytest.mark.llamacpp
def test_llama_bench_loads_split_model(tmp_path: Path, llama_bench: Path) -> None:
    paths = write_gguf(tmp_path / "split.gguf", tiny_spec("qwen3moe"), uniform_recipe("Q8_0"),
                       split_max_bytes=1 << 20)
    assert len(paths) > 1
    rows = _bench(llama_bench, paths[0])
    assert all(r["avg_ts"] > 0 for r in rows)
