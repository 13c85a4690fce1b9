"""benchmarks/gpu_binaries.py on real binaries (the CPU llama.cpp build stands in for the CUDA one: the packing,
the parts, the CPU check and the build's skip are the same): saved in parts no larger than a device call brings
back, loaded on the same CPU they start and the build is skipped; on another CPU, or with a part missing, nothing
is put in place and the build runs."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.llamacpp


@pytest.fixture
def gb(bench_script):
    return bench_script("gpu_binaries")


def _workdir_with_build(tmp_path, llama_bench):
    bin_dir = tmp_path / "built" / "llama.cpp-cuda" / "build" / "bin"
    bin_dir.mkdir(parents=True)
    for name in ("llama-bench", "llama-fit-params"):
        shutil.copy2(llama_bench.parent / name, bin_dir / name)
    return tmp_path / "built", bin_dir


@pytest.mark.slow              # ~15 s: xz of 23 MB on 2 cores
def test_binaries_saved_in_parts_come_back_on_the_same_cpu_and_the_build_is_skipped(gb, llama_bench, tmp_path):
    built, bin_dir = _workdir_with_build(tmp_path, llama_bench)
    out = tmp_path / "out"
    parts = gb.save(built, out, part_bytes=2 << 20)
    assert len(parts) >= 2 and all(p.stat().st_size <= 2 << 20 for p in parts)
    assert [p.name for p in parts] == [f"llama.cpp-cuda.tar.xz.{i:02d}" for i in range(len(parts))]
    # ik's build is not there: not saved, nothing in its name
    assert not list(out.glob("ik_llama.cpp-cuda*"))

    fresh = tmp_path / "fresh"
    assert gb.load(out, fresh) == ["llama.cpp-cuda"]
    new_bin = fresh / "llama.cpp-cuda" / "build" / "bin"
    for name in ("llama-bench", "llama-fit-params"):
        assert (new_bin / name).read_bytes() == (bin_dir / name).read_bytes()
    r = subprocess.run([str(new_bin / "llama-bench"), "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "usage" in r.stdout.lower()
    # llamacpp_gpu.sh's build finds them and does not build (no CUDA compiler is needed for that)
    r = subprocess.run(["bash", str(ROOT / "benchmarks" / "llamacpp_gpu.sh"), "build", "no-tarball-needed.tar.gz",
                        str(fresh)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "skipped" in r.stderr

    # another CPU (a -march=native build may not run there): not used
    other = tmp_path / "other"
    assert gb.load(out, other, me={"model": "Some Other CPU", "flags": "0" * 16}) == []
    assert not (other / "llama.cpp-cuda" / "build" / "bin" / "llama-bench").exists()
    # a part lost on the way: not used
    parts[1].unlink()
    assert gb.load(out, tmp_path / "partial") == []


def test_bad_input_is_one_line_and_exit_2(gb, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("OUT", raising=False)
    assert gb.main(["load", str(tmp_path / "nowhere")]) == 2
    assert gb.main(["save", "--workdir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("gpu_binaries: error:") for line in err)
    # nothing built: saved nothing, still exit 0 (the next machine builds)
    assert gb.main(["save", "--workdir", str(tmp_path), "--out", str(tmp_path / "o")]) == 0
    assert not any((tmp_path / "o").iterdir())
