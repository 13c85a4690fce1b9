"""planner/workload.py: the user's workload as request classes, from a preset, a TOML file or a JSONL usage log."""
from __future__ import annotations

import json

import pytest

from planner.errors import InputError
from planner.workload import MAX_LOG_CLASSES, PRESETS, RequestClass, Workload, load, preset


def test_presets_say_what_the_issue_asks():
    chat, agent, rag, batch = (preset(n) for n in ("chat", "agent", "rag", "batch"))
    assert {c.new_tokens for c in chat.classes} == {300} and {c.gen_tokens for c in chat.classes} == {400}
    assert max(c.cached_tokens for c in chat.classes) == 8192 and min(c.cached_tokens for c in chat.classes) == 0
    assert [(c.cached_tokens, c.new_tokens) for c in agent.classes] == [(16384, 2048), (24576, 4096), (32768, 6144)]
    assert rag.classes == (RequestClass(16384, 0, 250),)
    assert batch.slots == 4 and batch.classes[0].new_tokens == 1024 and batch.classes[0].gen_tokens == 500
    # the context: the longest request per slot, times the slots (llama-server splits -c across -np)
    assert agent.ctx == 32768 + 6144 + 300 and batch.ctx == 4 * (1024 + 500)
    assert set(PRESETS) == {"chat", "agent", "rag", "batch"}


def test_mean_request_time_is_the_weighted_mean():
    w = Workload("w", (RequestClass(100, 0, 10, weight=3.0), RequestClass(200, 50, 20, weight=1.0)))
    # 3 parts of 1 s and 1 part of 5 s
    assert w.mean_request_s(lambda c: 1.0 if c.new_tokens == 100 else 5.0) == pytest.approx(2.0)
    assert w.tokens_per_request() == pytest.approx((3 * 110 + 220) / 4)


def test_toml_workload(tmp_path):
    f = tmp_path / "mine.toml"
    f.write_text('name = "support"\n[[request]]\nnew_tokens = 500\ncached_tokens = 4000\ngen_tokens = 200\n'
                 'weight = 2\n[[request]]\nnew_tokens = 3000\ngen_tokens = 100\nin_flight = 2\n')
    w = load(str(f))
    assert w.name == "support" and w.classes == (RequestClass(500, 4000, 200, 2), RequestClass(3000, 0, 100, 1, 2))
    assert load("mine.toml", base=tmp_path) == w


@pytest.mark.parametrize("text, words", [
    ("[[request]]\ncached_tokens = 5\n", "new_tokens is missing"),
    ("[[request]]\nnew_tokens = -1\n", "new_tokens = -1"),
    ("[[request]]\nnew_tokens = 10\nspeed = 3\n", "unknown key 'speed'"),
    ("[[request]]\nnew_tokens = 10\nweight = 0\n", "weight = 0"),
    ("[[request]]\nnew_tokens = 10\nin_flight = 1000\n", "in_flight = 1000"),
    ("[[request]]\nnew_tokens = 0\ngen_tokens = 0\ncached_tokens = 9\n", "measures nothing"),
    ("title = 3\n", "unknown key 'title'"),
    ("[[request]\n", "not TOML"),
    ("", "give 1-64 [[request]] tables"),
])
def test_bad_toml_is_one_line(tmp_path, text, words):
    f = tmp_path / "bad.toml"
    f.write_text(text)
    with pytest.raises(InputError, match=words.replace("[", r"\[")) as e:
        load(str(f))
    assert "\n" not in str(e.value) and "bad.toml" in str(e.value)


def test_unknown_name_lists_the_presets():
    with pytest.raises(InputError, match="chat, agent, rag, batch"):
        load("chatty")
    with pytest.raises(InputError, match="No such file"):
        load("/nonexistent/w.toml")


def test_jsonl_log_of_openai_usage(tmp_path):
    f = tmp_path / "log.jsonl"
    lines = [{"usage": {"prompt_tokens": 18000, "prompt_tokens_details": {"cached_tokens": 16000},
                        "completion_tokens": 300}}] * 3 + \
            [{"prompt_tokens": 1000, "cached_tokens": 0, "completion_tokens": 50}]
    f.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    w = load(str(f))
    assert w.name == "log"
    # two groups: the agent-like one (3 requests) and the short one; new = prompt - cached
    assert sorted((c.new_tokens, c.cached_tokens, c.gen_tokens, c.weight) for c in w.classes) == \
        [(1000, 0, 50, 1.0), (2000, 16000, 300, 3.0)]


def test_a_long_log_folds_into_few_classes(tmp_path):
    f = tmp_path / "big.jsonl"
    with open(f, "w") as out:
        for i in range(2000):
            out.write(json.dumps({"prompt_tokens": 100 + 37 * i, "completion_tokens": 10 + i % 300}) + "\n")
    w = load(str(f))
    assert 1 < len(w.classes) <= MAX_LOG_CLASSES
    assert sum(c.weight for c in w.classes) == 2000      # every request counted once


@pytest.mark.parametrize("line, words", [
    ("{not json", "not JSON"),
    ('{"prompt_tokens": 10, "cached_tokens": 20, "completion_tokens": 1}', "cached_tokens 20 > prompt_tokens 10"),
    ('{"prompt_tokens": "many", "completion_tokens": 1}', "prompt_tokens = 'many'"),
    ("[1, 2]", "expected an object"),
])
def test_bad_log_line_names_its_line(tmp_path, line, words):
    f = tmp_path / "log.jsonl"
    f.write_text('{"prompt_tokens": 10, "completion_tokens": 5}\n' + line + "\n")
    with pytest.raises(InputError, match=words) as e:
        load(str(f))
    assert "log.jsonl:2" in str(e.value)


def test_an_empty_log_is_an_error(tmp_path):
    f = tmp_path / "empty.jsonl"
    f.write_text("\n")
    with pytest.raises(InputError, match="no requests"):
        load(str(f))


def test_a_logs_classes_keep_their_longest_request(tmp_path):
    f = tmp_path / "log.jsonl"
    # one class: five 28000 + 160 requests and one 32768 + 192 (mean 28795 + 165); many small groups besides,
    # so that folding (past MAX_LOG_CLASSES) moves a lone long request into its nearest kept class
    lines = [{"prompt_tokens": 28000, "completion_tokens": 160}] * 5 + \
        [{"prompt_tokens": 32768, "completion_tokens": 192}] + \
        [{"prompt_tokens": 100 * 2 ** i, "completion_tokens": 10} for i in range(8) for _ in range(6)] + \
        [{"prompt_tokens": 45000, "completion_tokens": 300}]
    f.write_text("".join(json.dumps(x) + "\n" for x in lines))
    w = load(str(f))
    assert len(w.classes) == MAX_LOG_CLASSES
    big = max(w.classes, key=lambda c: c.context_tokens)
    assert big.context_tokens < 32768 + 192 < big.longest_context       # its mean is smaller than its longest
    assert big.weight == 7 and big.longest_tokens == 45000 + 300         # the lone 45000 + 300, folded in
    assert w.slot_ctx == 45300 and w.ctx == 45300
    assert "longest request 45300" in w.describe()
    assert all("longest_tokens" in c for c in w.to_dict()["classes"])
    # a preset's classes are their sizes: no longest_tokens in its dict (a study's stored settings compare equal)
    assert all("longest_tokens" not in c for c in preset("agent").to_dict()["classes"])
    assert "longest request 39212, ctx 39212" in preset("agent").describe()
    with pytest.raises(InputError, match="longest_tokens"):
        RequestClass(10, longest_tokens=0)
