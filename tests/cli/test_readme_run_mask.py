"""The README's `run` example is checked with only what the machine decides masked (tests/readme_examples.py
MASKS): another machine's plan id, speeds, spread and RSS pass; a changed command line or result does not."""
from __future__ import annotations

from readme_examples import _norm, matched

README = ["# llamacpp: measuring plan 2c14792ec3a4 (64 prompt + 16 generated tokens at depth 0, 2 reps)",
          "command: llama-bench -o jsonl -m tiny.gguf -p 64 -n 16 -r 2 -ngl 0 -b 2048 -ub 512 -t 2 -fa 1",
          "result:  ok",
          "PP 43657.35 t/s (43181.10-44133.60 over 2 reps), TG 10540.55 t/s (10204.50-10876.60 over 2 reps); "
          "host peak RSS 28.25 MiB"]
CMD = "run tiny.gguf --engine llamacpp --n-prompt 64 --n-gen 16 --reps 2 -- -ngl 0 -t 2"


def _same(got: list[str], command: str = CMD) -> bool:
    new = matched(README, got)
    return new is not None and [_norm(x, command) for x in new] == [_norm(x, command) for x in README]


def test_another_machines_numbers_pass():
    got = [README[0].replace("2c14792ec3a4", "0123456789ab"), README[1], README[2],
           "PP 1004.11 t/s (718.75-1289.47 over 2 reps), TG 7787.40 t/s (687.90-14886.90 over 2 reps); "
           "host peak RSS 129.09 MiB"]
    assert _same(got)
    assert not _same(got, "plan tiny.gguf")          # masked for run alone


def test_what_the_program_says_still_counts():
    assert not _same([README[0], README[1].replace("-t 2", "-t 4"), *README[2:]])
    assert not _same([*README[:2], "result:  failed", README[3]])
    assert not _same([*README[:3], README[3].replace("over 2 reps", "over 3 reps")])
    assert not _same(README[:3])                                    # the speeds line gone
