"""The README's example outputs are what the program prints (issue 'first hour' 1): every `$ offload-tuner` block
run and compared (tests/readme_examples.py); `make readme` rewrites them."""
from __future__ import annotations

import pytest

from readme_examples import ROOT, check, examples, matched


@pytest.mark.slow
def test_the_readme_examples_are_the_programs_output():
    problems = check(ROOT / "README.md")
    assert not problems, "the README's examples drifted (make readme rewrites them):\n" + "\n".join(problems)


def test_a_drifted_example_is_found_and_rewritten(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("text\n\n```\n$ offload-tuner inspect preset:Qwen3-30B-A3B | head -2\nold first line\n"
                      "old second\n```\n\n```\n$ offload-tuner inspect preset:Qwen3-30B-A3B\nQwen3-30B-A3B Q4_K_M "
                      "(qwen3moe, 48 layers, 128 experts / 8 used, 17.28 GiB)\n...\n```\n")
    assert [e.command for e in examples(readme.read_text())] == ["inspect preset:Qwen3-30B-A3B | head -2",
                                                                  "inspect preset:Qwen3-30B-A3B"]
    problems = check(readme)
    assert len(problems) == 1 and "head -2: line 1: README 'old first line'" in problems[0]
    check(readme, write=True)
    text = readme.read_text()
    assert "old first line" not in text and text.count("Qwen3-30B-A3B Q4_K_M (qwen3moe") == 2
    assert check(readme) == [] and "\n...\n```" in text         # the shortened block kept its cut


def test_runs_between_cuts_are_placed_by_their_label():
    got = ["a", "b", "llama-server:", "  cmd 1", "llama-cli:", "  cmd 2"]
    assert matched(["...", "llama-server:", "  old"], got) == ["...", "llama-server:", "  cmd 1"]
    assert matched(["a", "...", "nowhere: x"], got) is None
    assert matched(["a", "x"], got) == got                        # no cut: the whole output
