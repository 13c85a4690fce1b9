"""The CUDA builds of benchmarks/llamacpp_gpu.sh, kept across device machines: a fresh machine spends ~5 minutes
building mainline's llama-bench and ~18 building ik's llama-sweep-bench (H100 box, 16 cores, 2026-11-24), a large
part of a session's device time. `save` packs the built binaries as xz archives cut into parts small enough to come
back from a device call (at most 16 MiB a file); carried to the next machine, `load` puts them where the build
looks, so `llamacpp_gpu.sh build` / `build-ik` skip. The builds are -march=native (GGML_NATIVE, as measured so
far): an archive holds the CPU it was built on and is used only on the same CPU model and flags, and only when the
binary starts there; otherwise the build runs as before.

    there:  python3 benchmarks/gpu_binaries.py save [--workdir W] [--out DIR]    # DIR default $OUT
    here:   copy the parts from the call's files into build/gpu-bin/ (git-ignored), carry them
    there:  python3 benchmarks/gpu_binaries.py load build/gpu-bin [--workdir W]  # before llamacpp_gpu.sh build*

A call brings back at most 64 MiB and carries at most 64 MiB, and the mainline pair alone is 81 MiB of xz (6 parts,
2026-11-24): `save --out benchmarks/results/gpu-bin-parts` (a folder kept between calls of one machine), then
`cp benchmarks/results/gpu-bin-parts/*.0[0-3] $OUT` in one call and the rest in the next. On the next machine,
carry the parts as separate paths over two calls (`build/gpu-bin/llama.cpp-cuda.tar.xz.00`, ...: a path not named
in a call's carry stays where an earlier call left it) and `load` once all are there; a missing part leaves the
build to run.

Exit 0 (also when nothing could be saved or used: the build then runs), 2 on bad input.
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_WORKDIR = ROOT / "benchmarks" / "results" / "llamacpp_gpu"
# build folder under the workdir -> the binaries the GPU benchmarks run from it (ik's: sweep-bench alone)
BUILDS: dict[str, tuple[str, ...]] = {"llama.cpp-cuda": ("llama-bench", "llama-fit-params"),
                                      "ik_llama.cpp-cuda": ("llama-sweep-bench",)}
PART_BYTES = 15 << 20          # a device call brings back files of at most 16 MiB
STAMP = "built-on.json"        # inside each archive: the CPU it was built on


def log(msg: str) -> None:
    print(f"gpu_binaries: {msg}", file=sys.stderr, flush=True)


def cpu_identity(cpuinfo: str | None = None) -> dict[str, str]:
    """The CPU a -march=native build depends on: its model name and a digest of its instruction-set flags."""
    text = cpuinfo if cpuinfo is not None else Path("/proc/cpuinfo").read_text(errors="replace")
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("model name", "flags") and key.strip() not in fields:
            fields[key.strip()] = value.strip()
    flags = " ".join(sorted(fields.get("flags", "").split()))
    return {"model": fields.get("model name", "unknown"), "flags": hashlib.sha256(flags.encode()).hexdigest()[:16]}


def save(workdir: Path, out: Path, part_bytes: int = PART_BYTES) -> list[Path]:
    """Each complete build under workdir as NAME.tar.xz.NN parts in out; the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for name, binaries in BUILDS.items():
        bin_dir = workdir / name / "build" / "bin"
        missing = [b for b in binaries if not (bin_dir / b).is_file()]
        if missing:
            log(f"{name}: not saved ({', '.join(missing)} not built in {bin_dir})")
            continue
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:xz", preset=6) as tar:
            for b in binaries:
                tar.add(bin_dir / b, arcname=b)
            stamp = json.dumps(cpu_identity(), indent=1).encode()
            info = tarfile.TarInfo(STAMP)
            info.size = len(stamp)
            tar.addfile(info, io.BytesIO(stamp))
        data = buf.getvalue()
        for old in out.glob(f"{name}.tar.xz.*"):
            old.unlink()
        for i in range(0, len(data), part_bytes):
            part = out / f"{name}.tar.xz.{i // part_bytes:02d}"
            part.write_bytes(data[i:i + part_bytes])
            written.append(part)
        size = sum((bin_dir / b).stat().st_size for b in binaries)
        log(f"{name}: {len(binaries)} binaries, {size / 2**20:.0f} MiB -> {len(data) / 2**20:.1f} MiB in "
            f"{-(-len(data) // part_bytes)} parts")
    return written


def load(src: Path, workdir: Path, timeout_s: float = 60.0, me: dict[str, str] | None = None) -> list[str]:
    """Unpack each build archived in src into workdir when it was built on this CPU (`me`, default
    cpu_identity()) and its binaries start here; the names of the builds now in place."""
    placed: list[str] = []
    me = me or cpu_identity()
    for name, binaries in BUILDS.items():
        parts = sorted(src.glob(f"{name}.tar.xz.[0-9][0-9]"))
        if not parts:
            continue
        if [p.name for p in parts] != [f"{name}.tar.xz.{i:02d}" for i in range(len(parts))]:
            log(f"{name}: parts {[p.name for p in parts]} are not 00..{len(parts) - 1:02d}: not used")
            continue
        data = b"".join(p.read_bytes() for p in parts)
        try:
            with tarfile.open(fileobj=io.BytesIO(data), mode="r:xz") as tar:
                built_on = json.loads(tar.extractfile(STAMP).read())
                if built_on != me:
                    log(f"{name}: built on {built_on['model']} (flags {built_on['flags']}), this is {me['model']} "
                        f"(flags {me['flags']}): not used, the build runs")
                    continue
                bin_dir = workdir / name / "build" / "bin"
                bin_dir.mkdir(parents=True, exist_ok=True)
                for b in binaries:
                    (bin_dir / b).write_bytes(tar.extractfile(b).read())
                    (bin_dir / b).chmod(0o755)
        except (tarfile.TarError, KeyError, AttributeError, EOFError, OSError, ValueError) as e:
            log(f"{name}: archive unreadable ({type(e).__name__}: {e}): not used")
            continue
        if not _starts(bin_dir / binaries[0], timeout_s):
            for b in binaries:
                (bin_dir / b).unlink(missing_ok=True)
            continue
        placed.append(name)
        log(f"{name}: {', '.join(binaries)} in place ({len(data) / 2**20:.1f} MiB archive)")
    return placed


def _starts(binary: Path, timeout_s: float) -> bool:
    """Does the binary run here (its --help, which loads the CUDA runtime and its libraries)?"""
    try:
        r = subprocess.run([str(binary), "--help"], capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as e:
        log(f"{binary.name}: does not start here ({e}): removed, the build runs")
        return False
    if r.returncode not in (0, 1) or "error while loading shared libraries" in r.stderr:
        log(f"{binary.name}: --help exited {r.returncode} ({(r.stderr.strip().splitlines() or [''])[-1][:200]}): "
            "removed, the build runs")
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("save", help="pack the built binaries into --out")
    s.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR)
    s.add_argument("--out", type=Path, help="default $OUT")
    ld = sub.add_parser("load", help="put archived binaries in place when they fit this machine")
    ld.add_argument("src", type=Path, help="the folder with the NAME.tar.xz.NN parts")
    ld.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR)
    args = ap.parse_args(argv)
    if args.cmd == "save":
        out = args.out or (Path(os.environ["OUT"]) if os.environ.get("OUT") else None)
        if out is None:
            print("gpu_binaries: error: give --out (no $OUT here)", file=sys.stderr)
            return 2
        save(args.workdir, out)
        return 0
    if not args.src.is_dir():
        print(f"gpu_binaries: error: {args.src}: no such folder", file=sys.stderr)
        return 2
    load(args.src, args.workdir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
