"""Failed runs keep the first failure's cause (the verbose re-run adds to it, never replaces it), and llama-bench
output is untrusted: any shape becomes a failed measurement with the reason, never a traceback."""
from __future__ import annotations

from pathlib import Path

import pytest

from runtime.llamacpp import LlamaCppEngine
from test_llamacpp_engine import MAINLINE_HELP, TINY, script

GOOD = ('{"n_prompt": 8, "n_gen": 0, "n_depth": 0, "avg_ts": 100.0, "stddev_ts": 0.0, "samples_ts": [100.0]}\n'
        '{"n_prompt": 0, "n_gen": 2, "n_depth": 0, "avg_ts": 10.0, "stddev_ts": 0.0, "samples_ts": [10.0]}')


def _bench(tmp_path: Path, plain: str, verbose: str) -> Path:
    return script(tmp_path / "llama-bench", f"""case "$1" in --help) cat <<'EOF'
{MAINLINE_HELP}EOF
exit 0;; esac
for a in "$@"; do [ "$a" = "-v" ] && {{ {verbose}
}}; done
{plain}
""")


def test_crash_that_does_not_repeat_keeps_the_signal(tmp_path):
    fake = _bench(tmp_path, "echo 'GGML_ASSERT(x) failed' >&2; kill -SEGV $$", f"cat <<'EOF'\n{GOOD}\nEOF\nexit 0")
    m = LlamaCppEngine(fake, timeout_s=30).measure_args(["-p", "8"], TINY)
    assert not m.ok and m.raw["failure"] == "crash"
    assert "SIGSEGV" in m.error and "did not repeat" in m.error, m.error


def test_rerun_reason_is_added_to_the_first_cause(tmp_path):
    fake = _bench(tmp_path, "echo 'GGML_ASSERT(x) failed' >&2; kill -ABRT $$",
                  "echo 'llama_model_load: error loading model: tensor data is not within the file bounds' >&2; "
                  "echo 'failed to load model' >&2; exit 1")
    m = LlamaCppEngine(fake, timeout_s=30).measure_args(["-p", "8"], TINY)
    assert not m.ok and m.raw["failure"] == "crash"
    assert "SIGABRT" in m.error and "verbose re-run" in m.error and "file bounds" in m.error, m.error


@pytest.mark.parametrize("out", [
    '{"n_prompt": 8, "n_gen": 0, "avg_ts": "fast", "stddev_ts": 0, "samples_ts": [1]}',
    '{"n_prompt": 8, "n_gen": 0, "avg_ts": 100.0, "stddev_ts": 0, "samples_ts": 5}',
    '{"n_prompt": 8, "n_gen": 0, "avg_ts": "100.0", "samples_ts": ["100"]}',
    '{"n_prompt": 8, "n_gen": 0, "avg_ts": -1.0}',
    '{"n_prompt": "eight", "n_gen": [], "avg_ts": {}}',
    '[1, 2, 3]',
    '{"n_prompt": 8' + '[' * 5000,
    '{"n_prompt": ' + '[' * 100_000 + ']' * 100_000 + '}',      # nested past Python's recursion limit
    '\x00\xff garbage \x1b[31m',
    '',
])
def test_any_output_shape_is_a_failed_measurement(out, tmp_path):
    fake = _bench(tmp_path, f"cat <<'EOF'\n{out}\nEOF\nexit 0", "exit 0")
    m = LlamaCppEngine(fake, timeout_s=30).measure_args(["-p", "8"], TINY)
    assert not m.ok and m.error and "\n" not in m.error.strip()
