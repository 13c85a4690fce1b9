"""On a GPU box: does the CUDA ik_llama.cpp place tensors where planner/flags says, for the rules a CPU build
cannot show (docs/ik_llama.md)? One device command, a minute with the build in place:

    bash benchmarks/llamacpp_gpu.sh build-ik            # once (resumable)
    PYTHONPATH=. python3 benchmarks/ik_gpu_check.py [--bin DIR] [--out DIR]

For each command line (tiny synthetic models, run with llama-sweep-bench, which reads the server's flags and needs
no tokenizer) it compares, from ik's own log:
- "Tensor NAME (...) buffer type overridden to BUFT" against our matcher's override list (-ot, -ncmoe, the
  several-GPU -ncmoe spread, -ngl 0 dropping everything);
- "Setting default device in layer N to D" against our byte-based -ts split (2+ GPUs);
- the "Layer N: weights, kv, total, compute MiB" table against planner/flags/ik_split.layer_sizes.
Writes ik_gpu_check.json and .md to --out (default $OUT, else benchmarks/results). Exit 1 on any mismatch.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from planner.flags import parse
from planner.flags.common import allocated_names, match_overrides
from planner.flags.ik_split import SizeParams, layer_sizes
from planner.gguf_header import load_inventory
from runtime.llamacpp_output import device_of_buft
from runtime.synth import tiny_spec, uniform_recipe, write_gguf

MiB = 1 << 20
_OVER = re.compile(r"Tensor (\S+) \(size = [\d.]+ MiB\) buffer type overridden to (\S+)")
_DEFAULT = re.compile(r"Setting default device in layer\s+(\d+) to (\d+)")
_SIZES = re.compile(r"Layer\s+(\d+):\s+([\d.]+),\s+([\d.]+),\s+([\d.]+)")

CASES_1 = ["-ngl 99 -ot exps=CPU", "-ngl 3", "-ngl 99 -ncmoe 2", "-ngl 99 -cmoe",
           "-ngl 0 -ot exps=CPU", r"-ngl 99 -ot blk\.1\.ffn_up_exps=CUDA0,exps=CPU"]
CASES_2 = ["-ngl 99 -ts 1,1", "-ngl 99 -ts 3,1", "-ngl 99 -ts 1,1 -ncmoe 3", "-ngl 5 -ts 1,2 -ncmoe 2",
           "-ngl 99 -ts 2,1 -ot exps=CPU"]


def gpu_count() -> int:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
    except OSError:
        return 0
    return len([ln for ln in out.splitlines() if ln.startswith("GPU ")])


def check(sweep: Path, model: Path, args: str, n_gpus: int) -> dict:
    inv = load_inventory(model)
    argv = [str(sweep), "-m", str(model), *args.split(), "-c", "512", "-n", "2", "-nrep", "1"]
    r = subprocess.run(argv, capture_output=True, text=True, errors="replace", timeout=300)
    log = r.stdout + r.stderr
    out: dict = {"args": args, "model": model.name, "rc": r.returncode, "mismatches": []}
    if r.returncode != 0:
        out["mismatches"].append(f"exit {r.returncode}: {log[-600:]}")
        return out
    pc = parse(["-m", str(model), *args.split(), "-c", "512"], inv, "ik", tool="cli", n_gpus=n_gpus)
    res = match_overrides(allocated_names(inv), pc.overrides)
    ours = {name: pc.overrides[i].device for name, i in res.first.items()}
    theirs: dict[str, str] = {}
    for name, buft in _OVER.findall(log):
        theirs.setdefault(name, device_of_buft(buft))
    if ours != theirs:
        diff = sorted(set(ours.items()) ^ set(theirs.items()))[:6]
        out["mismatches"].append(f"overrides differ: {diff}")
    defaults = {int(a): f"CUDA{b}" for a, b in _DEFAULT.findall(log)}
    if defaults:
        for il, dev in defaults.items():
            if il < inv.hparams.n_layer + (1 if pc.n_gpu_layers > inv.hparams.n_layer else 0) \
                    and pc.layer_devices[il] != dev:
                out["mismatches"].append(f"layer {il}: ik {dev}, ours {pc.layer_devices[il]}")
    sizes = {int(a): (float(w), float(kv)) for a, w, kv, _ in _SIZES.findall(log)}
    if sizes:
        ours_sizes, _ = layer_sizes(inv, SizeParams.of(pc.knobs, "cli"))
        worst = max(abs(ours_sizes[il] / MiB - (w + kv)) for il, (w, kv) in sizes.items() if il < len(ours_sizes))
        out["layer_size_max_err_mib"] = round(worst, 3)
        if worst > 0.02:
            out["mismatches"].append(f"layer sizes differ by up to {worst:.3f} MiB")
    out["ok"] = not out["mismatches"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin", default="benchmarks/results/llamacpp_gpu/ik_llama.cpp-cuda/build/bin")
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = ap.parse_args()
    sweep = Path(args.bin) / "llama-sweep-bench"
    n = gpu_count()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    models = {}
    # deepseek2 with DeepSeek's MLA widths: ik refuses other one-KV-head MLA models (src/llama-hparams.cpp ~1083)
    ds = dict(kv_lora_rank=512, n_rot=64, head_dim_k=576, head_dim_v=512, head_dim_k_mla=128, head_dim_v_mla=64)
    for arch, kw in (("qwen3moe", {"n_layer": 6}), ("deepseek2", {"n_layer": 5, **ds})):
        models[arch] = write_gguf(out_dir / f"ik-check-{arch}.gguf", tiny_spec(arch, **kw), uniform_recipe("Q8_0"))[0]
    cases = CASES_1 + (CASES_2 if n >= 2 else [])
    rows = [check(sweep, models[arch], c, n) for arch in models for c in cases]
    (out_dir / "ik_gpu_check.json").write_text(json.dumps({"gpus": n, "rows": rows}, indent=2))
    lines = [f"# ik placement on {n} GPU(s) vs planner/flags", "", "| model | args | ok | notes |", "|---|---|---|---|"]
    lines += [f"| {r['model']} | `{r['args']}` | {'yes' if r.get('ok') else 'NO'} | "
              f"{'; '.join(r['mismatches'])[:200]} |"
              for r in rows]
    (out_dir / "ik_gpu_check.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    for m in models.values():
        m.unlink(missing_ok=True)
    return 0 if all(r.get("ok") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
