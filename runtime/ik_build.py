"""Build a CPU ik_llama.cpp (llama-bench, llama-sweep-bench, llama-cli) from the pinned source, once per machine.

The source is ik_llama.cpp at commit 8337e4cd (2026-08-15), pruned to what these three programs need
(vendor/README.md says what is inside). It is looked up in this order: $OFFLOAD_TUNER_IK_TARBALL, the copy
committed under vendor/, and ../shared/vendor beside the repository; none of them is needed at run time, only by
the tests and by `python -m runtime.ik_build`. The build is cached under ~/.cache/offload-tuner/ (override with
$OFFLOAD_TUNER_CACHE) behind a file lock, like runtime/llamacpp_build.py for mainline.

Why the CMake options (cold build times: docs/ik_llama.md):
- GGML_IQK_FA_ALL_QUANTS=OFF: ik's CPU flash-attention kernels are instantiated for f16, bf16, q8_0 and q6_0
  KV caches only (every quant type otherwise); the tests use f16 and q8_0.
- -O1 instead of -O3: the iqk GEMM and flash-attention files are template-heavy; -O1 compiles them several times
  faster and the tiny test models still run in milliseconds; no test measures CPU speed.
- What cannot go: GGML_IQK_MUL_MAT=OFF does not compile (ggml.c calls iqk_mul_mat_4d and friends
  unconditionally), and GGML_IQK_FLASH_ATTENTION=OFF does not link (ggml.c still calls iqk_flash_attn_noalibi).
- examples/CMakeLists.txt is replaced by one that adds only llama-bench, main (llama-cli) and sweep-bench, and
  the top-level add_subdirectory(pocs) is dropped: the pruned tarball lacks the other folders.
"""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from .llamacpp_build import build_locked, cache_dir, extract_prefix, sha256_of

IK_COMMIT = "8337e4cd3861406fc04e0854b1409cd1b027fbc9"
# ik's build number is the commit count of its history (cmake/build-info.cmake: git rev-list --count HEAD); the
# tarball has no .git, so we write the pinned values in and the binaries print "version: 4840 (8337e4cd)".
IK_BUILD_NUMBER = 4840
TARBALL_NAME = "ik_llama.cpp-8337e4cd.tar.xz"
TARBALL_SHA256 = "ca3ae31d0511ec62120f998d0b146945d278435b5c93365c4e12eb50c35ced97"
TARGETS = ("llama-bench", "llama-sweep-bench", "llama-cli")
ENV_TARBALL = "OFFLOAD_TUNER_IK_TARBALL"
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_CURL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DGGML_CCACHE=OFF",
    "-DGGML_IQK_FLASH_ATTENTION=ON", "-DGGML_IQK_FA_ALL_QUANTS=OFF",
    "-DCMAKE_C_FLAGS_RELEASE=-O1 -DNDEBUG", "-DCMAKE_CXX_FLAGS_RELEASE=-O1 -DNDEBUG",
)
# examples/CMakeLists.txt for the pruned tree: the three programs only (vendor README).
_EXAMPLES_CMAKE = """find_package(Threads REQUIRED)
include_directories(${CMAKE_CURRENT_SOURCE_DIR})
add_subdirectory(llama-bench)
add_subdirectory(main)
add_subdirectory(sweep-bench)
"""
_REPO = Path(__file__).resolve().parents[1]


class IkSourceMissing(FileNotFoundError):
    """No copy of the pinned ik_llama.cpp tarball was found (the message lists where we looked)."""


class IkBuildError(RuntimeError):
    """The ik_llama.cpp build could not be made (checksum or compile failed)."""


def build_dir() -> Path:
    return cache_dir() / f"ik_llama.cpp-{IK_COMMIT[:8]}-cpu"


def binary(name: str) -> Path:
    return build_dir() / "build" / "bin" / name


def tarball_candidates() -> list[Path]:
    env = os.environ.get(ENV_TARBALL)
    return ([Path(env)] if env else []) + [_REPO / "vendor" / TARBALL_NAME,
                                            _REPO.parent / "shared" / "vendor" / TARBALL_NAME]


def find_tarball() -> Path:
    """The first existing copy of the pinned tarball; IkSourceMissing (listing the places) otherwise."""
    for p in tarball_candidates():
        if p.is_file():
            return p
    raise IkSourceMissing(f"{TARBALL_NAME} not found (looked in {', '.join(str(p) for p in tarball_candidates())}); "
                          f"set ${ENV_TARBALL} to a copy")


def _extract(tarball: Path, src: Path) -> None:
    digest = sha256_of(tarball)
    if digest != TARBALL_SHA256:
        raise IkBuildError(f"sha256 of {tarball} is {digest}, expected {TARBALL_SHA256}")
    tmp = src.with_name(src.name + ".tmp")
    extract_prefix(tarball, "ik_llama.cpp/", tmp)
    (tmp / "examples" / "CMakeLists.txt").write_text(_EXAMPLES_CMAKE)
    info = tmp / "cmake" / "build-info.cmake"
    info.write_text(info.read_text().replace("set(BUILD_NUMBER 0)", f"set(BUILD_NUMBER {IK_BUILD_NUMBER})")
                    .replace('set(BUILD_COMMIT "unknown")', f'set(BUILD_COMMIT "{IK_COMMIT[:8]}")')
                    # a tree inside another git checkout (the GPU box's copy of this repository) would take that
                    # repository's commit count as ik's build number and look like a build from before PR 698
                    .replace("# Get the commit count and hash\nif(Git_FOUND)",
                             "# Get the commit count and hash\nif(FALSE)"))
    top = tmp / "CMakeLists.txt"
    top.write_text(top.read_text().replace("add_subdirectory(pocs)", "# add_subdirectory(pocs)  (pruned)"))
    shutil.rmtree(src, ignore_errors=True)
    tmp.rename(src)


def prepare_source(dest: Path, tarball: Path | None = None) -> Path:
    """The patched source tree (what ensure_built compiles) at dest/src; benchmarks/llamacpp_gpu.sh build-ik
    builds the CUDA binaries from it."""
    src = Path(dest) / "src"
    if not (src / "CMakeLists.txt").exists():
        src.parent.mkdir(parents=True, exist_ok=True)
        _extract(tarball or find_tarball(), src)
    return src


def ensure_built(targets: tuple[str, ...] = TARGETS, log=sys.stderr) -> dict[str, Path]:
    """Return {target: path}, building what is missing. Safe to call from several processes at once.

    Raises IkSourceMissing when no tarball is found, IkBuildError when the checksum or the compile fails."""
    return build_locked(build_dir(), targets, lambda src: _extract(find_tarball(), src), CMAKE_OPTIONS,
                        f"ik_llama.cpp {IK_COMMIT[:8]} (~13 min on 2 busy cores)", IkBuildError, log)


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "--source":      # --source DIR [TARBALL]
        print(prepare_source(Path(sys.argv[2]), Path(sys.argv[3]) if len(sys.argv) > 3 else None))
    else:
        for name, path in ensure_built().items():
            print(name, path)
