"""Fixtures shared by every test folder: tiny synthetic GGUF files and the CPU llama.cpp build.

pytest (import mode "prepend") puts this folder on sys.path when it imports this file, so the helpers beside it
(bench_scripts.py, cli_outcome.py) import by bare name from any test folder; a helper one folder uses stays in
that folder (tests/planner/tiny.py, gguf_fuzz.py, loader_verdict.py)."""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any
from collections.abc import Callable

import pytest

from runtime.synth import tiny_spec, uniform_recipe, write_gguf

TinyGGUF = Callable[..., Path]

# A plan for --gpu alone has this machine's RAM (offload_tuner/app/common.py machine_ram_bytes): every test, and every
# worker a test starts, sees the generic desktop's 128 GiB instead, whatever machine runs them
os.environ["OFFLOAD_TUNER_RAM"] = "128GiB"


@pytest.fixture
def tiny_gguf(tmp_path: Path) -> TinyGGUF:
    """tiny_gguf(arch, quant="Q8_0", expert_quant=None, **write_gguf kwargs) -> path of the (first) file.

    The model is runtime.synth.tiny_spec(arch) with runtime.synth.uniform_recipe(quant, expert_quant)."""
    def make(arch: str, quant: str = "Q8_0", expert_quant: str | None = None, **kwargs: Any) -> Path:
        out = tmp_path / f"tiny-{arch}-{quant}.gguf"
        return write_gguf(out, tiny_spec(arch), uniform_recipe(quant, expert_quant), **kwargs)[0]
    return make


def _skip_without_toolchain(what: str) -> None:
    missing = [tool for tool, names in (("cmake", ["cmake"]), ("a C++ compiler", ["c++", "g++", "clang++"]))
               if not any(shutil.which(n) for n in names)]
    if missing:
        pytest.skip(f"cannot build {what} here: no {' and no '.join(missing)}")


@pytest.fixture(scope="session")
def llama_bench() -> Path:
    """Path of the CPU llama-bench, built once per machine (minutes the first time). Skips only when the
    machine cannot build it at all (no cmake or no C++ compiler); CI has both, so CI builds it."""
    _skip_without_toolchain("llama.cpp")
    from runtime.llamacpp_build import ensure_built
    return ensure_built()["llama-bench"]


@pytest.fixture(scope="session")
def llama_server() -> Path:
    """Path of the CPU mainline llama-server, built once per machine in the same tree as llama-bench (the server's
    objects only: see docs/llamacpp.md section 12 for the cold time). Skips only without cmake or a compiler."""
    _skip_without_toolchain("llama.cpp")
    from runtime.server_process import server_binary
    return server_binary("mainline")


@pytest.fixture(scope="session")
def ik_server() -> Path:
    """Path of the CPU ik_llama.cpp 8337e4cd llama-server, built once per machine in the same tree as the other ik
    programs, from the pinned tarball and its server tarball (vendor/). Skips without cmake or a compiler, or
    without a copy of either tarball; a failed build fails."""
    _skip_without_toolchain("ik_llama.cpp")
    from runtime.ik_build import IkSourceMissing
    from runtime.server_process import server_binary
    try:
        return server_binary("ik")
    except IkSourceMissing as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def ik_binaries() -> dict[str, Path]:
    """{"llama-bench", "llama-sweep-bench", "llama-cli": path} of the CPU ik_llama.cpp 8337e4cd build, built once
    per machine from the pinned tarball (vendor/, else ../shared/vendor; ~13 min cold on 2 busy cores). Skips when
    the machine cannot build it (no cmake or compiler) or no copy of the tarball exists; a failed build fails."""
    _skip_without_toolchain("ik_llama.cpp")
    from runtime.ik_build import IkSourceMissing, ensure_built
    try:
        return ensure_built()
    except IkSourceMissing as e:
        pytest.skip(str(e))


@pytest.fixture
def bench_script():
    """bench_scripts.load_benchmark for one test: the modules it loads leave sys.modules afterwards."""
    import sys

    from bench_scripts import load_benchmark
    loaded: list[str] = []

    def load(name: str) -> Any:
        loaded.append(name)
        return load_benchmark(name)
    yield load
    for name in loaded:
        sys.modules.pop(name, None)
