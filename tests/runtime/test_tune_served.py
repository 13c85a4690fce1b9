"""`tune --llama-server`: after the search, the finalists and llama-server's own --fit are served on the workload
(the real CPU llama-server, every plan on the CPU), and the study's JSON says first what it recommends."""
from __future__ import annotations

import json
import subprocess

from offload_tuner import cli
from runtime.synth import tiny_spec, uniform_recipe, write_gguf


def test_tune_serves_the_finalists_and_the_fit_references(tmp_path, llama_server, capsys):
    model = write_gguf(tmp_path / "tiny.gguf", tiny_spec("qwen3moe"), uniform_recipe("Q8_0"), vocab=True)[0]
    (tmp_path / "w.toml").write_text('name = "tiny"\n[[request]]\nnew_tokens = 32\ncached_tokens = 32\n'
                                     "gen_tokens = 8\n")
    argv = ["tune", str(model), "--gpu", "6GiB", "--workload", str(tmp_path / "w.toml"), "--trials", "3",
            "--pool", "10", "--storage", f"sqlite:///{tmp_path / 's.db'}", "--study", "s", "--no-report",
            "--llama-server", str(llama_server), "--cpu-stand-in", "--json", "--quiet"]
    assert cli.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert list(out)[0] == "headline" and out["headline"].startswith("tiny: ")
    served = out["served"]
    assert served["workload"] == "tiny" and served["reference"].startswith("fit:") and served["pick"]
    keys = [r["key"] for r in served["results"]]
    assert keys[:3] == ["fit:512", "fit:2048", "fit:4096"] and any(k.startswith("trial:") for k in keys)
    assert all(r["request_s"]["samples"] for r in served["results"])          # 2 rounds, every server answered
    # one thread count for all, --fit too (the best finalist's): placement is compared, not -t
    threads = {r["command"].split(" -t ")[1].split()[0] for r in served["results"] if r.get("command")}
    assert len(threads) == 1 and int(threads.pop()) > 0, served["results"]
    assert subprocess.run(["pgrep", "-x", "llama-server"], capture_output=True).returncode == 1   # none left
    # serving needs the workload: another objective is one line, exit 2
    assert cli.main([*argv[:-2], "--objective", "tg", "--study", "s2"]) == 2
    assert "--llama-server serves the workload" in capsys.readouterr().err
