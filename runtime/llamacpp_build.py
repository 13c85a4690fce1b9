"""Build a CPU llama.cpp (llama-bench, llama-fit-params; llama-server on request) from the llama-cpp-python sdist,
once per machine.

The sdist vendors llama.cpp under vendor/llama.cpp (docs/llamacpp.md, section 10). We pin it by
version and sha256 so every machine builds the same engine, and cache the result under
~/.cache/offload-tuner/ (override with $OFFLOAD_TUNER_CACHE). Used by the planner's memory test and the
llamacpp engine's integration tests.
"""
from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import sys
import tarfile
from pathlib import Path
from collections.abc import Callable, Sequence

from planner import children

log = logging.getLogger(__name__)

SDIST_VERSION = "0.3.36"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
TARGETS = ("llama-bench", "llama-fit-params")
SERVER = "llama-server"      # ensure_built((SERVER,)): the same configured tree, only the server's objects are new
# ggml's AMX path segfaults on Q8_0/Q4_0 prompt processing on the CI CPUs (docs/llamacpp.md section 10).
_NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


class BuildError(RuntimeError):
    """The llama.cpp build could not be made (download, checksum or compile failed)."""


def cache_dir() -> Path:
    return Path(os.environ.get("OFFLOAD_TUNER_CACHE", Path.home() / ".cache" / "offload-tuner"))


def build_dir() -> Path:
    return cache_dir() / f"llama.cpp-{SDIST_VERSION}-cpu"


def binary(name: str) -> Path:
    return build_dir() / "build" / "bin" / name


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fetch_sdist(dest: Path) -> Path:
    tarball = dest / f"llama_cpp_python-{SDIST_VERSION}.tar.gz"
    if not tarball.exists():
        dest.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               f"llama-cpp-python=={SDIST_VERSION}", "-d", str(dest)]
        r = children.run(cmd, capture_output=True, text=True)
        if r.returncode != 0 or not tarball.exists():
            raise BuildError(f"could not download llama-cpp-python {SDIST_VERSION}: {r.stderr.strip()[-400:]}")
    digest = sha256_of(tarball)
    if digest != SDIST_SHA256:
        tarball.unlink()
        raise BuildError(f"sha256 of {tarball.name} is {digest}, expected {SDIST_SHA256}; deleted, retry")
    return tarball


def extract_prefix(tarball: Path, prefix: str, dest: Path) -> None:
    """The members of `tarball` under `prefix` (a folder path ending in /), written to `dest` without it."""
    shutil.rmtree(dest, ignore_errors=True)
    with tarfile.open(tarball) as tar:
        members = []
        for m in tar.getmembers():
            if m.name.startswith(prefix) and len(m.name) > len(prefix):
                m.name = m.name[len(prefix):]
                members.append(m)
        try:
            tar.extractall(dest, members=members, filter="data")
        except TypeError:      # Python < 3.11.4 (the GPU box's python3): no filter argument
            tar.extractall(dest, members=members)


def _extract_llama_cpp(tarball: Path, src: Path) -> None:
    tmp = src.with_name(src.name + ".tmp")
    extract_prefix(tarball, f"llama_cpp_python-{SDIST_VERSION}/vendor/llama.cpp/", tmp)
    tmp.rename(src)


def build_locked(root: Path, targets: Sequence[str], source: Callable[[Path], None], options: Sequence[str],
                 what: str, error: type[Exception],
                 extend: Callable[[Path, Sequence[str]], None] | None = None) -> dict[str, Path]:
    """{target: root/build/bin/target}, configuring and building with CMake what is missing under a file lock (so
    several processes can ask at once); `source(src)` writes the tree first when root/src has none, and
    `extend(src, missing)` may then add to an existing tree what the missing targets need. `error` carries a failed
    step's output tail."""
    root.mkdir(parents=True, exist_ok=True)
    binaries = {t: root / "build" / "bin" / t for t in targets}
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        missing = [t for t, path in binaries.items() if not path.exists()]
        if missing:
            src, bld = root / "src", root / "build"
            if not (src / "CMakeLists.txt").exists():
                source(src)
            if extend is not None:
                extend(src, missing)
            log.info("offload-tuner: building %s (%s), once per machine...", what, " ".join(missing))
            for cmd in (["cmake", "-S", str(src), "-B", str(bld), *options],
                        ["cmake", "--build", str(bld), "--config", "Release", "-j", str(os.cpu_count() or 2),
                         "--target", *missing]):
                r = children.run(cmd, capture_output=True, text=True)
                if r.returncode != 0:
                    raise error(f"{' '.join(cmd[:3])} failed: {(r.stdout + r.stderr).strip()[-800:]}")
    return binaries


def ensure_built(targets: tuple[str, ...] = TARGETS) -> dict[str, Path]:
    """Return {target: path}, building what is missing (`(SERVER,)`: llama-server). Safe to call from several
    processes at once."""
    # The server's web UI (tools/ui, scripts/ui-assets.cmake) is built with npm only with LLAMA_BUILD_UI and else
    # downloaded from a Hugging Face bucket at build time unless LLAMA_USE_PREBUILT_UI=OFF: with both off the
    # server embeds an empty asset table and the build needs no network. LLAMA_OPENSSL=OFF: no HTTPS (cpp-httplib).
    options = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF",
               "-DLLAMA_BUILD_TESTS=OFF", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_UI=OFF",
               "-DLLAMA_USE_PREBUILT_UI=OFF", f"-DCMAKE_C_FLAGS={_NO_AMX}", f"-DCMAKE_CXX_FLAGS={_NO_AMX}"]
    what = f"llama.cpp {SDIST_VERSION}" + (" (the server: ~8 min on 2 busy cores)" if SERVER in targets else "")
    return build_locked(build_dir(), targets, lambda src: _extract_llama_cpp(_fetch_sdist(cache_dir() / "sdist"), src),
                        options, what, BuildError)

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")     # the "building ..." line
    for name, path in ensure_built(tuple(sys.argv[1:]) or TARGETS).items():
        print(name, path)
