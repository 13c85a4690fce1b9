"""Build a CPU ik_llama.cpp (llama-bench, llama-sweep-bench, llama-cli; llama-server on request) from the pinned
source, once per machine.

The source is ik_llama.cpp at commit 8337e4cd (2026-08-15), pruned to what these three programs need
(vendor/README.md says what is inside). It is looked up in this order: $OFFLOAD_TUNER_IK_TARBALL, then the copy
committed under vendor/ (the product looks nowhere outside its own tree); neither is needed at run time, only by
the tests and by `python -m runtime.ik_build`. The build is cached under ~/.cache/offload-tuner/ (override with
$OFFLOAD_TUNER_CACHE) behind a file lock, like runtime/llamacpp_build.py for mainline.

llama-server needs a second, smaller tarball of the same commit (examples/server, examples/mtmd which the server
links, vendor/miniaudio which mtmd compiles, scripts/xxd.cmake; vendor README), looked up beside the first. It is
added to the same source tree the first time `ensure_built(("llama-server",))` asks, so the library objects of the
other programs are reused. The server embeds two gzipped web UIs (4.6 MB that xz cannot shrink; ik has no CMake
switch to leave them out): the tarball leaves them out and we write small stand-in pages in their place
(`--webui none` serves none anyway).

Why the CMake options (cold build times: docs/ik_llama.md):
- GGML_IQK_FA_ALL_QUANTS=OFF: ik's CPU flash-attention kernels are instantiated for f16, bf16, q8_0 and q6_0
  KV caches only (every quant type otherwise); the tests use f16 and q8_0.
- -O1 instead of -O3: the iqk GEMM and flash-attention files are template-heavy; -O1 compiles them several times
  faster and the tiny test models still run in milliseconds; no test measures CPU speed.
- What cannot go: GGML_IQK_MUL_MAT=OFF does not compile (ggml.c calls iqk_mul_mat_4d and friends
  unconditionally), and GGML_IQK_FLASH_ATTENTION=OFF does not link (ggml.c still calls iqk_flash_attn_noalibi).
- examples/CMakeLists.txt is replaced by one that adds only llama-bench, main (llama-cli) and sweep-bench (and mtmd
  and server when LLAMA_BUILD_SERVER is on and the server tarball was added), and the top-level
  add_subdirectory(pocs) is dropped: the pruned tarball lacks the other folders.
"""
from __future__ import annotations

import gzip
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from .llamacpp_build import build_locked, cache_dir, extract_prefix, sha256_of

IK_COMMIT = "8337e4cd3861406fc04e0854b1409cd1b027fbc9"
# ik's build number is the commit count of its history (cmake/build-info.cmake: git rev-list --count HEAD); the
# tarball has no .git, so we write the pinned values in and the binaries print "version: 4840 (8337e4cd)".
IK_BUILD_NUMBER = 4840
TARBALL_NAME = "ik_llama.cpp-8337e4cd.tar.xz"
TARBALL_SHA256 = "ca3ae31d0511ec62120f998d0b146945d278435b5c93365c4e12eb50c35ced97"
SERVER_TARBALL_NAME = "ik_llama.cpp-8337e4cd-server.tar.xz"
SERVER_TARBALL_SHA256 = "23cd161d4513674dc7daa8199f198df7776294775fc934717d5099fdb4eac58d"
TARGETS = ("llama-bench", "llama-sweep-bench", "llama-cli")
SERVER = "llama-server"
ENV_TARBALL = "OFFLOAD_TUNER_IK_TARBALL"
# LLAMA_BUILD_SERVER only decides whether our examples/CMakeLists.txt adds the server (when its source is there);
# LLAMA_SERVER_SSL and LLAMA_SERVER_SQLITE3 stay at their OFF defaults: no OpenSSL, no SQLite, no network.
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_CURL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=ON", "-DGGML_CCACHE=OFF",
    "-DGGML_IQK_FLASH_ATTENTION=ON", "-DGGML_IQK_FA_ALL_QUANTS=OFF",
    "-DCMAKE_C_FLAGS_RELEASE=-O1 -DNDEBUG", "-DCMAKE_CXX_FLAGS_RELEASE=-O1 -DNDEBUG",
)
# examples/CMakeLists.txt for the pruned tree: the three programs, and the server once its tarball is in (vendor
# README). The server links mtmd, so mtmd comes with it.
_EXAMPLES_CMAKE = """find_package(Threads REQUIRED)
include_directories(${CMAKE_CURRENT_SOURCE_DIR})
add_subdirectory(llama-bench)
add_subdirectory(main)
add_subdirectory(sweep-bench)
if (LLAMA_BUILD_SERVER AND EXISTS ${CMAKE_CURRENT_SOURCE_DIR}/server/CMakeLists.txt)
    add_subdirectory(mtmd)
    add_subdirectory(server)
endif()
"""
# The web UI pages examples/server/CMakeLists.txt embeds (xxd.cmake) that the server tarball leaves out: each gets
# a small gzipped stand-in (gzip with mtime 0, so the generated header is the same on every machine).
_STAND_IN_ASSETS = ("public/index.html.gz", "public_llamacpp/index_llamacpp.html.gz")
_STAND_IN_PAGE = (b"<!doctype html><title>llama-server</title><p>This ik_llama.cpp build has no web UI "
                  b"(offload-tuner's pruned source); the HTTP API is complete.</p>\n")
_REPO = Path(__file__).resolve().parents[1]


class IkSourceMissing(FileNotFoundError):
    """No copy of the pinned ik_llama.cpp tarball was found (the message lists where we looked)."""


class IkBuildError(RuntimeError):
    """The ik_llama.cpp build could not be made (checksum or compile failed)."""


def build_dir() -> Path:
    return cache_dir() / f"ik_llama.cpp-{IK_COMMIT[:8]}-cpu"


def binary(name: str) -> Path:
    return build_dir() / "build" / "bin" / name


def tarball_candidates(name: str = TARBALL_NAME) -> list[Path]:
    """Where a pinned tarball is looked for: $OFFLOAD_TUNER_IK_TARBALL (the server tarball: beside it), then
    vendor/."""
    env = os.environ.get(ENV_TARBALL)
    first = [] if not env else [Path(env) if name == TARBALL_NAME else Path(env).with_name(name)]
    return first + [_REPO / "vendor" / name]


def find_tarball(name: str = TARBALL_NAME) -> Path:
    """The first existing copy of a pinned tarball; IkSourceMissing (listing the places) otherwise."""
    for p in tarball_candidates(name):
        if p.is_file():
            return p
    raise IkSourceMissing(f"{name} not found (looked in {', '.join(str(p) for p in tarball_candidates(name))}); "
                          f"set ${ENV_TARBALL} to a copy of {TARBALL_NAME} (with {SERVER_TARBALL_NAME} beside it)")


def _check_sha(tarball: Path, expected: str) -> None:
    digest = sha256_of(tarball)
    if digest != expected:
        raise IkBuildError(f"sha256 of {tarball} is {digest}, expected {expected}")


def _extract(tarball: Path, src: Path) -> None:
    _check_sha(tarball, TARBALL_SHA256)
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


def has_server_source(src: Path) -> bool:
    return (src / "examples" / "server" / "CMakeLists.txt").is_file()


def add_server_source(tarball: Path, src: Path) -> None:
    """Add the server tarball's files to an extracted tree `src` (none of them is in the first tarball), the stand-in
    web pages, and the examples/CMakeLists.txt that adds the server."""
    _check_sha(tarball, SERVER_TARBALL_SHA256)
    tmp = src.with_name(src.name + ".server.tmp")
    extract_prefix(tarball, "ik_llama.cpp/", tmp)
    server = tmp / "examples" / "server"
    for rel in _STAND_IN_ASSETS:
        (server / rel).parent.mkdir(parents=True, exist_ok=True)
        (server / rel).write_bytes(gzip.compress(_STAND_IN_PAGE, mtime=0))
    # the CMakeLists last: has_server_source() is true only once every other file is in place
    cmake = server / "CMakeLists.txt"
    cmake_text = cmake.read_text()
    cmake.unlink()
    shutil.copytree(tmp, src, dirs_exist_ok=True)
    shutil.rmtree(tmp)
    (src / "examples" / "server" / "CMakeLists.txt").write_text(cmake_text)
    (src / "examples" / "CMakeLists.txt").write_text(_EXAMPLES_CMAKE)


def _extend(src: Path, missing: Sequence[str]) -> None:
    """build_locked's hook: a tree extracted without the server gets it when the server is to be built."""
    if SERVER in missing and not has_server_source(src):
        add_server_source(find_tarball(SERVER_TARBALL_NAME), src)


def prepare_source(dest: Path, tarball: Path | None = None) -> Path:
    """The patched source tree (what ensure_built compiles) at dest/src, with the server's source when its tarball
    is found; benchmarks/llamacpp_gpu.sh build-ik builds the CUDA binaries from it."""
    src = Path(dest) / "src"
    if not (src / "CMakeLists.txt").exists():
        src.parent.mkdir(parents=True, exist_ok=True)
        _extract(tarball or find_tarball(), src)
    if not has_server_source(src):
        server = (tarball.with_name(SERVER_TARBALL_NAME) if tarball is not None else None)
        if server is None or not server.is_file():
            server = next((p for p in tarball_candidates(SERVER_TARBALL_NAME) if p.is_file()), None)
        if server is not None:
            add_server_source(server, src)
    return src


def ensure_built(targets: tuple[str, ...] = TARGETS) -> dict[str, Path]:
    """Return {target: path}, building what is missing; `("llama-server",)` builds the server (adding its source
    to the tree first). Safe to call from several processes at once.

    Raises IkSourceMissing when no tarball is found, IkBuildError when the checksum or the compile fails."""
    what = (f"ik_llama.cpp {IK_COMMIT[:8]} (~13 min on 2 busy cores"
            + (", the server ~5 min more)" if SERVER in targets else ")"))
    return build_locked(build_dir(), targets, lambda src: _extract(find_tarball(), src), CMAKE_OPTIONS,
                        what, IkBuildError, extend=_extend)


if __name__ == "__main__":
    import logging
    logging.basicConfig(level=logging.INFO, format="%(message)s")     # the "building ..." line
    if len(sys.argv) >= 3 and sys.argv[1] == "--source":      # --source DIR [TARBALL]
        print(prepare_source(Path(sys.argv[2]), Path(sys.argv[3]) if len(sys.argv) > 3 else None))
    else:                                                     # [TARGET ...], e.g. llama-server
        for name, path in ensure_built(tuple(sys.argv[1:]) or TARGETS).items():
            print(name, path)
