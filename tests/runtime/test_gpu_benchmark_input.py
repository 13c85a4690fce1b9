"""The GPU benchmark scripts with several steps share their input handling: bad input is one line and exit 2."""
from __future__ import annotations

import pytest


@pytest.mark.parametrize("name", ["ik_gpu", "multi_gpu"])
def test_bad_input_is_one_line_and_exit_2(bench_script, name, tmp_path, capsys):
    bench = bench_script(name)
    assert bench.main(["--workdir", str(tmp_path), "--model", str(tmp_path / "nope.gguf")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no such file" in err[0]
    with pytest.raises(SystemExit) as e:
        bench.main(["--steps", "memory,bogus"])
    assert e.value.code == 2
