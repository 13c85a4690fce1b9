"""Every option mainline llama-server and llama-cli accept, with how many values each takes.

Generated from common/arg.cpp of llama.cpp as vendored in llama-cpp-python 0.3.36 (commit 0c1e57098): every
`add_opt(common_arg(...))` whose examples include LLAMA_EXAMPLE_COMMON, _SERVER or _CLI (and that the tool does
not exclude); value count from the handler type (void/bool: 0, int/string: 1, str_str: 2). Negated spellings
(`--no-...`) of boolean options are included. Data only: planner/flags/mainline.py interprets the few that affect
placement.
"""
from __future__ import annotations

# (number of values, tools) -> spellings
_GROUPS: dict[tuple[int, tuple[str, ...]], tuple[str, ...]] = {
    (0, ('cli',)): (
        '--display-prompt', '--multiline-input', '--no-display-prompt', '--no-show-timings', '--show-timings',
        '--simple-io', '--single-turn', '--verbose-prompt', '-mli', '-st',
    ),
    (0, ('server',)): (
        '--agent', '--cache-idle-slots', '--cache-prompt', '--cont-batching', '--cors-credentials',
        '--embd-gemma-default', '--embedding', '--embeddings', '--fim-qwen-1.5b-default', '--fim-qwen-14b-spec',
        '--fim-qwen-30b-default', '--fim-qwen-3b-default', '--fim-qwen-7b-default', '--fim-qwen-7b-spec',
        '--kv-unified', '--lora-init-without-apply', '--metrics', '--models-autoload', '--no-agent',
        '--no-cache-idle-slots', '--no-cache-prompt', '--no-cont-batching', '--no-cors-credentials',
        '--no-kv-unified', '--no-models-autoload', '--no-prefill-assistant', '--no-slots', '--no-ui',
        '--no-ui-mcp-proxy', '--no-webui', '--no-webui-mcp-proxy', '--prefill-assistant', '--props', '--rerank',
        '--reranking', '--reuse-port', '--slots', '--spm-infill', '--ui', '--ui-mcp-proxy', '--webui',
        '--webui-mcp-proxy', '-ag', '-cb', '-kvu', '-no-ag', '-no-kvu', '-nocb',
    ),
    (0, ('server', 'cli')): (
        '--backend-sampling', '--cache-list', '--check-tensors', '--completion-bash', '--context-shift',
        '--cpu-moe', '--cpu-moe-draft', '--escape', '--gpt-oss-120b-default', '--gpt-oss-20b-default', '--help',
        '--ignore-eos', '--jinja', '--kv-offload', '--list-devices', '--log-disable', '--log-jsonl',
        '--log-prefix', '--log-timestamps', '--log-verbose', '--mmproj-auto', '--mmproj-offload',
        '--no-context-shift', '--no-escape', '--no-host', '--no-jinja', '--no-kv-offload', '--no-log-jsonl',
        '--no-log-prefix', '--no-log-timestamps', '--no-mmproj', '--no-mmproj-auto', '--no-mmproj-offload',
        '--no-op-offload', '--no-perf', '--no-reasoning-preserve', '--no-repack', '--no-skip-chat-parsing',
        '--no-spec-draft-backend-sampling', '--no-warmup', '--offline', '--op-offload', '--perf',
        '--reasoning-preserve', '--repack', '--skip-chat-parsing', '--spec-default',
        '--spec-draft-backend-sampling', '--spec-draft-cpu-moe', '--special', '--swa-full', '--usage',
        '--verbose', '--version', '--vision-gemma-12b-default', '--vision-gemma-4b-default', '--warmup', '-bs',
        '-cl', '-cmoe', '-cmoed', '-e', '-h', '-kvo', '-nkvo', '-nr', '-sp', '-v',
    ),
    (1, ('cli',)): (
        '--audio', '--binary-file', '--color', '--file', '--image', '--output', '--output-file', '--prompt',
        '--server-base', '--system-prompt', '--system-prompt-file', '--video', '-bf', '-co', '-f', '-o', '-p',
        '-sys', '-sysf',
    ),
    (1, ('server',)): (
        '--alias', '--api-key', '--api-key-file', '--api-prefix', '--cache-reuse', '--checkpoint-min-step',
        '--cors-headers', '--cors-methods', '--cors-origins', '--embd-normalize', '--host',
        '--kv-unified-per-slot', '--lookup-cache-dynamic', '--lookup-cache-static', '--mcp-servers-config',
        '--mcp-servers-json', '--media-path', '--models-dir', '--models-max', '--models-preset',
        '--mtmd-batch-max-tokens', '--path', '--pooling', '--port', '--sleep-idle-seconds',
        '--slot-prompt-similarity', '--slot-save-path', '--spec-ngram-min-hits', '--spec-ngram-size-m',
        '--spec-ngram-size-n', '--sse-ping-interval', '--ssl-cert-file', '--ssl-key-file', '--tags',
        '--threads-http', '--timeout', '--tools', '--tools-runtime', '--ui-config', '--ui-config-file',
        '--webui-config', '--webui-config-file', '-a', '-cms', '-lcd', '-lcs', '-sps', '-to',
    ),
    (1, ('server', 'cli')): (
        '--adaptive-decay', '--adaptive-target', '--batch-size', '--cache-ram', '--cache-type-k',
        '--cache-type-k-draft', '--cache-type-v', '--cache-type-v-draft', '--chat-template',
        '--chat-template-file', '--chat-template-kwargs', '--control-vector', '--control-vector-scaled',
        '--cpu-mask', '--cpu-mask-batch', '--cpu-mask-batch-draft', '--cpu-mask-draft', '--cpu-range',
        '--cpu-range-batch', '--cpu-range-draft', '--cpu-strict', '--cpu-strict-batch',
        '--cpu-strict-batch-draft', '--cpu-strict-draft', '--ctx-checkpoints', '--ctx-size', '--defrag-thold',
        '--device', '--device-draft', '--docker-repo', '--draft', '--draft-max', '--draft-min', '--draft-n',
        '--draft-n-min', '--draft-p-min', '--draft-p-split', '--dry-allowed-length', '--dry-base',
        '--dry-multiplier', '--dry-penalty-last-n', '--dry-sequence-breaker', '--dynatemp-exp',
        '--dynatemp-range', '--fit', '--fit-ctx', '--fit-target', '--flash-attn', '--frequency-penalty',
        '--gpu-layers', '--gpu-layers-draft', '--grammar', '--grammar-file', '--hf-file', '--hf-repo',
        '--hf-repo-draft', '--hf-token', '--image-max-tokens', '--image-min-tokens', '--json-schema',
        '--json-schema-file', '--keep', '--lazy-mode', '--load-mode', '--log-colors', '--log-file',
        '--log-prompts-dir', '--log-verbosity', '--logit-bias', '--lora', '--lora-scaled', '--main-gpu',
        '--min-p', '--mirostat', '--mirostat-ent', '--mirostat-lr', '--mmproj', '--mmproj-device',
        '--mmproj-url', '--model', '--model-draft', '--model-url', '--n-cpu-ffn', '--n-cpu-moe',
        '--n-cpu-moe-draft', '--n-gpu-layers', '--n-gpu-layers-draft', '--n-predict', '--numa', '--override-kv',
        '--override-tensor', '--override-tensor-draft', '--parallel', '--poll', '--poll-batch',
        '--poll-batch-draft', '--poll-draft', '--predict', '--presence-penalty', '--prio', '--prio-batch',
        '--prio-batch-draft', '--prio-draft', '--reasoning', '--reasoning-budget', '--reasoning-budget-message',
        '--reasoning-effort', '--reasoning-format', '--repeat-last-n', '--repeat-penalty', '--reverse-prompt',
        '--rope-freq-base', '--rope-freq-scale', '--rope-scale', '--rope-scaling', '--rpc', '--sampler-seq',
        '--samplers', '--sampling-seq', '--seed', '--spec-draft-cpu-mask', '--spec-draft-cpu-mask-batch',
        '--spec-draft-cpu-range', '--spec-draft-cpu-strict', '--spec-draft-cpu-strict-batch',
        '--spec-draft-device', '--spec-draft-hf', '--spec-draft-model', '--spec-draft-n-cpu-moe',
        '--spec-draft-n-max', '--spec-draft-n-min', '--spec-draft-ncmoe', '--spec-draft-ngl',
        '--spec-draft-override-tensor', '--spec-draft-p-min', '--spec-draft-p-split', '--spec-draft-poll',
        '--spec-draft-poll-batch', '--spec-draft-prio', '--spec-draft-prio-batch', '--spec-draft-threads',
        '--spec-draft-threads-batch', '--spec-draft-type-k', '--spec-draft-type-v',
        '--spec-ngram-map-k-min-hits', '--spec-ngram-map-k-size-m', '--spec-ngram-map-k-size-n',
        '--spec-ngram-map-k4v-min-hits', '--spec-ngram-map-k4v-size-m', '--spec-ngram-map-k4v-size-n',
        '--spec-ngram-mod-n-match', '--spec-ngram-mod-n-max', '--spec-ngram-mod-n-min',
        '--spec-ngram-simple-min-hits', '--spec-ngram-simple-size-m', '--spec-ngram-simple-size-n',
        '--spec-synth-len', '--spec-synth-rates', '--spec-type', '--split-mode', '--swa-checkpoints', '--temp',
        '--temperature', '--tensor-split', '--threads', '--threads-batch', '--threads-batch-draft',
        '--threads-draft', '--top-k', '--top-n-sigma', '--top-nsigma', '--top-p', '--typical', '--typical-p',
        '--ubatch-size', '--verbosity', '--video-ffmpeg-dir', '--video-fps', '--video-timestamp-interval',
        '--xtc-probability', '--xtc-threshold', '--yarn-attn-factor', '--yarn-beta-fast', '--yarn-beta-slow',
        '--yarn-ext-factor', '--yarn-orig-ctx', '-C', '-Cb', '-Cbd', '-Cd', '-Cr', '-Crb', '-Crd', '-b', '-c',
        '-cram', '-ctk', '-ctkd', '-ctv', '-ctvd', '-ctxcp', '-dev', '-devd', '-dr', '-dt', '-fa', '-fit',
        '-fitc', '-fitt', '-hf', '-hfd', '-hff', '-hfr', '-hfrd', '-hft', '-j', '-jf', '-l', '-lm', '-lv',
        '-lzm', '-m', '-md', '-mg', '-mm', '-mmdev', '-mmu', '-mu', '-n', '-ncffn', '-ncmoe', '-ncmoed', '-ngl',
        '-ngld', '-np', '-ot', '-otd', '-r', '-rea', '-s', '-sm', '-t', '-tb', '-tbd', '-td', '-ts', '-ub',
    ),
    (2, ('server', 'cli')): (
        '--control-vector-layer-range',
    ),
}

# tool -> {spelling: number of values}
KNOWN_ARGS: dict[str, dict[str, int]] = {
    tool: {s: n for (n, tools), spellings in _GROUPS.items() if tool in tools for s in spellings}
    for tool in ("server", "cli")
}
