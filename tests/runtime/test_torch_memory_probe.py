"""benchmarks/torch_memory_probe.py's replay of the CUDA allocator's history: the peak of allocated bytes, the
allocations alive at that moment, and their grouping by the engine line that made them (the GPU run itself is a
device benchmark: benchmarks/reported/torch_memory_probe_h100x2.md)."""
from __future__ import annotations


def test_the_replay_finds_the_peak_and_what_is_alive_then(bench_script):
    probe = bench_script("torch_memory_probe")
    ours = [{"filename": "/x/lib/torch/functional.py", "line": 3, "name": "mm"},
            {"filename": "/repo/runtime/torch_engine/kernels.py", "line": 7, "name": "grouped_experts"}]
    theirs = [{"filename": "/x/triton/driver.py", "line": 761, "name": "get_empty_cache_for_benchmark"}]
    MiB = 1 << 20
    trace = [{"action": "alloc", "addr": 1, "size": 100 * MiB, "frames": ours},
             {"action": "alloc", "addr": 2, "size": 300 * MiB, "frames": theirs},
             {"action": "free_requested", "addr": 2, "size": 300 * MiB},   # not yet free: the stream may use it
             {"action": "alloc", "addr": 3, "size": 50 * MiB, "frames": ours},
             {"action": "free_completed", "addr": 2, "size": 300 * MiB},
             {"action": "free_completed", "addr": 77, "size": 999},        # allocated before the recording: skipped
             {"action": "alloc", "addr": 4, "size": 200 * MiB, "frames": ours}]
    peak, alive = probe.alive_at_peak(trace)
    assert peak == 450 * MiB and sorted(alive) == [1, 2, 3]      # 100 + 300 + 50 before the big block was freed
    g = probe.groups(alive)
    assert g["engine_line"] == [("(no engine frame)", 300.0, 1),
                                ("runtime/torch_engine/kernels.py:7 grouped_experts", 150.0, 2)]
    assert g["innermost"] == [("driver.py:761 get_empty_cache_for_benchmark", 300.0, 1),
                              ("functional.py:3 mm", 150.0, 2)]
    assert probe.main(["--cpu"]) == 0
