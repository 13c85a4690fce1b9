"""The ggml-alloc replica (planner/ggml_graph.py) on hand-made graphs, and on a tiny model whose compute buffer
llama.cpp measured (no llama.cpp needed to run these)."""
from __future__ import annotations

from planner.archs import build_inventory
from planner.ggml_graph import OUTPUT, Compiled, DynAllocator, Graph, allocate_compiled
from planner.memory import compute_bytes
from planner.plan import Knobs, Plan
from runtime.synth import tiny_spec, uniform_recipe


def test_best_fit_skips_the_end_block_and_frees_merge():
    a = DynAllocator(32)
    x, y, z = a.alloc(100), a.alloc(10), a.alloc(100)      # sizes round up to 32: 128, 32, 128
    assert (x, y, z) == (0, 128, 160) and a.max_size == 288
    a.free(x, 100)
    assert a.alloc(120) == 0                                 # fits the hole exactly
    a.free(0, 120)
    assert a.alloc(200) == 288 and a.max_size == 512         # the hole is too small: the buffer grows
    a.free(y, 10)                                            # merges with the hole before it: [0, 160)
    assert a.alloc(150) == 0


def _cpu_peak(g: Graph) -> int:
    c = Compiled(g)
    return allocate_compiled(c, c.leafs, c.nodes, ["CPU"] * len(c.tensors), lambda d: 32)["CPU"]


def _chain(output: bool) -> Graph:
    g = Graph()
    x = Graph.input("x", (256,), "f32")                      # 1 KiB, freed after its only use
    h = g.mul_mat(Graph.weight("w", (256, 512), 1), x)       # 2 KiB
    if output:
        h.flags |= OUTPUT
    n = g.unary("RMS_NORM", h)                               # in place into h when h may be reused
    g.expand(g.binary("MUL", n, Graph.weight("g", (512,), 1)))
    return g


def test_inplace_reuse_unless_the_source_is_an_output():
    assert _cpu_peak(_chain(output=False)) == 1024 + 2048
    # an output is never reused nor freed: the norm needs 2 KiB more, and x's 1 KiB hole is too small
    assert _cpu_peak(_chain(output=True)) == 1024 + 2048 + 2048


def _viewed(keep: bool) -> Graph:
    g = Graph()
    x = Graph.input("x", (256, 4), "f32")                    # 4 KiB
    y = g.unary("SCALE", x)                                  # in place into x (its only consumer)
    if keep:
        y.flags |= OUTPUT
    z = g.cont(g.view(y, (256, 2)))                          # 2 KiB; y is read only through the view
    g.expand(g.mul_mat(Graph.weight("w", (256, 256), 1), z))  # 2 KiB: y is free by now, its 4 KiB are reused
    return g


def test_a_source_read_through_a_view_is_freed_after_the_view_is_consumed():
    assert _cpu_peak(_viewed(keep=False)) == 4096 + 2048
    assert _cpu_peak(_viewed(keep=True)) == 4096 + 2048 + 2048


def test_tiny_qwen3moe_compute_buffer_matches_llama_cpp():
    # llama-bench -p 512 -n 0 -ub 256 -fa 1 on tiny_spec("qwen3moe") F16 printed
    # "~llama_context: CPU compute buffer size is 2.7568 MiB"; an instrumented ggml-alloc reported 2890752 bytes
    inv = build_inventory(tiny_spec("qwen3moe"), uniform_recipe("F16"))
    plan = Plan("tiny", {t.name: "CPU" for t in inv.allocated()}, Knobs(n_ctx=512, n_ubatch=256))
    assert compute_bytes(inv, plan) == {"CPU": 2890752}
    # the largest set of tensors alive at once is 2375680 bytes: the rest is the allocator's fragmentation
