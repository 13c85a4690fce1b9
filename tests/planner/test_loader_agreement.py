"""We accept exactly the files llama.cpp accepts: on a seeded corpus of structurally mutated small models
(tests/planner/gguf_fuzz.py STRUCTURAL: dropped / renamed / duplicated / extra / reshaped / retyped tensors,
dropped and changed keys, gaps and out-of-order data, wrong tensor counts, fused attn_qkv and ffn_gate_up_exps),
`explain --dialect mainline -- -ngl 0` and the CPU llama-bench (`-ngl 0`) must agree on every file."""
from __future__ import annotations

import pytest

import gguf_fuzz as gf
import loader_verdict as lv

pytestmark = pytest.mark.llamacpp
SEED = 4242
N_FILES = 120


@pytest.mark.slow
def test_our_verdict_is_llama_benchs_on_every_file(llama_bench, tmp_path):
    seeds = gf.make_seeds(tmp_path / "seeds")
    files = [(p, f"seed {a}") for a, p in seeds.items() if a != "split"]
    files += gf.corpus(seeds, tmp_path / "corpus", N_FILES, SEED, kinds=tuple(gf.STRUCTURAL),
                       archs=tuple(a for a in seeds if a != "split"))
    rows, accepted = [], 0
    for path, label in files:
        a, why_ours = lv.ours(path)
        b, why_theirs = lv.llama_bench(llama_bench, path)
        accepted += b
        if a != b:
            rows.append(f"{label}: ours {'accept' if a else 'refuse'} ({why_ours[:150]}), llama-bench "
                        f"{'accept' if b else 'refuse'} ({why_theirs[:150]})")
    assert not rows, f"{len(rows)} of {len(files)} files disagree:\n" + "\n".join(rows)
    assert 10 < accepted < len(files) - 10       # both verdicts well represented


@pytest.mark.parametrize("arch, kind", [("qwen3moe", "fuse_qkv"), ("gpt-oss", "fuse_qkv"),
                                        ("deepseek2", "fuse_gate_up"), ("qwen3moe", "fuse_gate_up")])
def test_fused_variants(arch, kind, llama_bench, tmp_path):
    """llama.cpp loads a fused attn_qkv (create_tensor_qkv) and a fused ffn_gate_up_exps where the architecture
    reads it (deepseek2), not elsewhere (qwen3moe); we agree, and model the fused tensors in memory."""
    import random
    seeds = gf.make_seeds(tmp_path / "seeds")
    raw = gf.parse(seeds[arch])
    gf.STRUCTURAL[kind](raw, random.Random(0))
    path = tmp_path / f"{arch}-{kind}.gguf"
    path.write_bytes(gf.encode(raw))
    assert lv.ours(path)[0] == lv.llama_bench(llama_bench, path)[0]
    if lv.ours(path)[0]:
        from planner.loader import load_model
        from planner.memory import estimate
        from planner.flags import parse
        from planner.hardware import from_gpu_sizes
        inv, ref = load_model(str(path)), load_model(str(seeds[arch]))
        assert inv.total_bytes() == ref.total_bytes()          # the same bytes, fused
        hw = from_gpu_sizes("24GiB")
        mems = [estimate(i, parse(["-ngl", "99", "-c", "512"], i, "mainline").to_plan(), hw).devices["CUDA0"]
                for i in (inv, ref)]
        assert mems[0].weights == mems[1].weights and mems[0].compute > 0
