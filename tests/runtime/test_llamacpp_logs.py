"""llama.cpp log parsers on real captured logs (tests/planner/data/*, from the CPU build of llama-cpp-python
0.3.36's llama.cpp on tiny synthetic models; the loader's per-key/per-tensor dump lines were trimmed)."""
from __future__ import annotations

from pathlib import Path

import pytest

from runtime.llamacpp_logs import (
    MiB, RESOLUTION_2DP, RESOLUTION_4DP, GraphStats, KVCacheSize, mib_to_bytes, parse_contexts,
    parse_fit_print, parse_log, parse_memory_breakdown, parse_model_buffers, parse_repacked_tensors,
)

DATA = Path(__file__).resolve().parents[1] / "planner" / "data"


def read(name: str) -> str:
    return (DATA / name).read_text()


def test_mib_values_become_bytes():
    assert mib_to_bytes("7.27") == round(7.27 * MiB)
    assert mib_to_bytes("2.7568") == round(2.7568 * MiB)
    assert MiB // 200 == RESOLUTION_2DP and MiB // 20000 < RESOLUTION_4DP


def test_llama_bench_qwen3moe_flash_attention():
    log = parse_log(read("llamabench_qwen3moe_fa.log"))
    assert log.model_buffers == {"CPU_Mapped": mib_to_bytes("7.27")}
    ctx = log.context
    assert (ctx.cparam("n_ctx"), ctx.cparam("n_batch"), ctx.cparam("n_ubatch")) == (512, 512, 256)
    assert ctx.cparams["flash_attn"] == "enabled"
    assert ctx.kv_buffers == {"CPU": MiB // 2}
    assert ctx.kv_caches == (KVCacheSize(512, 2, 1, 1, "f16", MiB // 4, "f16", MiB // 4),)
    assert ctx.compute_buffers == {"CPU": mib_to_bytes("2.76")}
    # the destructor's debug line has 4 decimals: the precise value wins
    assert ctx.compute("CPU") == mib_to_bytes("2.7568") and ctx.compute_resolution("CPU") == RESOLUTION_4DP
    assert ctx.output_buffers == {"CPU": 0}
    assert ctx.graph == GraphStats(nodes_pp=108, splits_pp=1, nodes_tg=108, splits_tg=1)


def test_swa_model_has_two_caches_and_the_buffers_add_up():
    ctx = parse_log(read("llamabench_gptoss_swa.log")).context
    # gpt-oss: one full-attention layer of 1024 cells, one SWA layer of pad256(min(1024, 128 + 256)) = 512
    assert [(c.cells, c.layers) for c in ctx.kv_caches] == [(1024, 1), (512, 1)]
    assert ctx.kv_buffers == {"CPU": mib_to_bytes("0.50") + mib_to_bytes("0.25")}
    assert ctx.kv_bytes == 3 * MiB // 4
    # K and V are each rounded to 2 decimals in the "size =" lines (0.125 MiB prints as 0.12)
    assert abs(sum(c.nbytes for c in ctx.kv_caches) - 3 * MiB // 4) <= 4 * RESOLUTION_2DP


def test_mla_cache_has_no_v():
    ctx = parse_log(read("llamabench_deepseek2_nofa.log")).context
    (cache,) = ctx.kv_caches
    assert (cache.cells, cache.layers, cache.v_bytes) == (256, 3, 0)
    assert cache.k_bytes == mib_to_bytes("0.42")
    assert ctx.cparams["flash_attn"] == "disabled"
    assert ctx.graph.nodes_pp == 191


def test_two_contexts_in_one_log_and_a_no_mmap_model_buffer():
    log = parse_log(read("llamabench_llama_q8_nommap_two_ctx.log"))
    assert log.model_buffers == {"CPU": mib_to_bytes("1.47")}    # -lm none: a plain CPU buffer, not CPU_Mapped
    assert [c.cparam("n_ctx") for c in log.contexts] == [256, 512]
    assert [c.kv_caches[0].type_k for c in log.contexts] == ["q8_0", "q8_0"]
    assert [c.compute("CPU") for c in log.contexts] == [mib_to_bytes("2.4131"), mib_to_bytes("5.0449")]
    assert parse_contexts(read("llamabench_llama_q8_nommap_two_ctx.log")) == log.contexts


def test_repacked_weights_get_their_own_buffer():
    text = read("llamabench_qwen3moe_q4_0_repack.log")
    assert parse_model_buffers(text) == {"CPU_Mapped": mib_to_bytes("1.99"), "CPU_REPACK": mib_to_bytes("1.97")}
    repacked = parse_repacked_tensors(text)
    assert repacked[0] == "output.weight" and "blk.1.ffn_up_exps.weight" in repacked
    assert "token_embd.weight" not in repacked and len(repacked) == 15


def test_fit_params_dry_run_and_its_memory_breakdown():
    text = read("fitparams_fitp_verbose.log")
    ctx = parse_log(text).context
    # no_alloc: the dummy KV buffer is 0 MiB, the "size =" line has the real size
    assert ctx.kv_buffers == {"CPU": 0} and ctx.kv_caches[0].nbytes == 4 * MiB
    assert ctx.compute("CPU") == mib_to_bytes("9.01")
    rows = parse_memory_breakdown(text)
    assert set(rows) == {"Host"}
    host = rows["Host"]
    assert (host.self_bytes, host.model, host.context, host.compute) == (20 * MiB, 7 * MiB, 4 * MiB, 9 * MiB)
    assert host.total is None and host.unaccounted is None
    fit = parse_fit_print(read("fitparams_fitp.out"))
    assert list(fit) == ["Host"]
    assert (fit["Host"].model, fit["Host"].context, fit["Host"].compute) == (7 * MiB, 4 * MiB, 9 * MiB)


def test_breakdown_gpu_rows_follow_common_fit_cpp_format():
    # the row format of common/fit.cpp common_memory_breakdown_print (template_gpu / template_other)
    text = "\n".join([
        "common_memory_breakdown_print: | memory breakdown [MiB] | total   free    self   model   context   compute    unaccounted |",  # noqa: E501 (verbatim log line)
        "common_memory_breakdown_print: |   - CUDA0 (H100 80GB HBM3) | 81079 = 60000 + (20000 = 18000 +    1500 +     500) +  1079 |",  # noqa: E501 (verbatim log line)
        "common_memory_breakdown_print: |   - Host                   |                   4000 =  3900 +       0 +     100           |",  # noqa: E501 (verbatim log line)
        "common_memory_breakdown_print: |   - CUDA_Host              |                     64 =     0 +       0 +      64           |",  # noqa: E501 (verbatim log line)
    ])
    rows = parse_memory_breakdown(text)
    gpu = rows["CUDA0"]
    assert gpu.description == "H100 80GB HBM3"
    assert (gpu.total, gpu.free, gpu.self_bytes) == (81079 * MiB, 60000 * MiB, 20000 * MiB)
    assert (gpu.model, gpu.context, gpu.compute, gpu.unaccounted) == (18000 * MiB, 1500 * MiB, 500 * MiB, 1079 * MiB)
    assert rows["CUDA_Host"].compute == 64 * MiB and rows["Host"].model == 3900 * MiB


def test_cuda_log_experts_in_ram():
    # a real CUDA llama-bench -v block (H100): -ngl 99 -ot exps=CPU, one CPU_Mapped and one CUDA0 model buffer,
    # the CPU backend's compute buffer is the pinned CUDA_Host one
    text = read("cuda_h100_llamabench_cases.log")
    block = text.split("=== CASE g2 ")[1].split("=== END g2")[0]
    log = parse_log(block)
    assert log.model_buffers == {"CPU_Mapped": mib_to_bytes("7.02"), "CUDA0": mib_to_bytes("1.02")}
    ctx = log.context
    assert ctx.kv_buffers == {"CUDA0": MiB}
    assert ctx.compute_buffers == {"CUDA0": mib_to_bytes("5.51"), "CUDA_Host": mib_to_bytes("2.01")}
    assert ctx.compute("CUDA0") == mib_to_bytes("5.5098") and ctx.compute("CUDA_Host") == mib_to_bytes("2.0137")
    assert ctx.compute("CPU") == 0
    assert ctx.graph.splits_pp > 1


def test_pp_tg_graph_line():
    # the form sched_reserve prints when the prompt and token graphs differ (llama-context.cpp)
    line = "sched_reserve: graph (pp bs=4096, tg bs=1): nodes = 4421 / 4419, splits = 62 / 2, input objects = 4 / 4"
    ctx = parse_log("llama_context: constructing llama_context\n" + line + "\n").context
    assert ctx.graph == GraphStats(4421, 62, 4419, 2)


def test_no_context_is_a_clear_error():
    log = parse_log("llama_model_load: error loading model: tensor 'x' data is not within the file bounds\n")
    assert log.contexts == () and log.model_buffers == {}
    with pytest.raises(ValueError, match="no llama_context"):
        _ = log.context


def test_ik_model_buffer_lines_are_read():
    """ik prints its model buffers as "llm_load_tensors: <buffer> buffer size" (src/llama.cpp ~4832), no "model"."""
    text = ("llm_load_tensors: ggml ctx size =    0.05 MiB\n"
            "llm_load_tensors:        CPU buffer size =   333.84 MiB\n"
            "llm_load_tensors:      CUDA0 buffer size = 16900.50 MiB\n"
            "llama_kv_cache_init:      CUDA0 KV buffer size =    48.00 MiB\n")
    assert parse_model_buffers(text) == {"CPU": mib_to_bytes("333.84"), "CUDA0": mib_to_bytes("16900.50")}
