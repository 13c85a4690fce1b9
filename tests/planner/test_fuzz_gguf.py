"""Hostile GGUF files through inspect, explain and plan: a seeded corpus of mutated copies of small valid files
(tests/planner/gguf_fuzz.py: byte flips, truncations, absurd counts, renamed / dropped / duplicated / extra
tensors, reshaped tensors, unknown type ids, dropped and changed keys, gaps, missing and damaged shards of a
split model). Every run ends in success or one clean line with exit 2: never a traceback, never a hang."""
from __future__ import annotations

import collections
from pathlib import Path

import pytest

import gguf_fuzz as gf
from cli_outcome import run_cli

SEED = 20251123          # the acceptance run (benchmarks/fuzz_acceptance.py) uses other seeds
N_FILES = 300


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[Path, str]]:
    root = tmp_path_factory.mktemp("fuzz")
    return gf.corpus(gf.make_seeds(root / "seeds"), root / "corpus", N_FILES, SEED)


@pytest.mark.slow
def test_every_kind_is_in_the_corpus(corpus):
    kinds = {label.split(":")[0].split()[-1] for _, label in corpus}
    assert set(gf.STRUCTURAL) | set(gf.BYTES) <= kinds | {"split"}, kinds


@pytest.mark.slow
def test_fuzzed_files_give_success_or_one_clean_line(corpus):
    counts: collections.Counter[str] = collections.Counter()
    bad = []
    for path, label in corpus:
        for argv in gf.commands(path):
            o = run_cli(argv, time_limit_s=20)
            counts[o.kind] += 1
            if not o.clean:
                bad.append((label, argv[0], o.kind, o.stderr[-600:]))
    assert not bad, f"{len(bad)} of {sum(counts.values())} runs not clean ({dict(counts)}); first: {bad[:3]}"
    assert counts["ok"] > 0 and counts["error"] > 0, counts
