#!/usr/bin/env bash
# Shell entry of the GPU benchmark (issue 4; benchmarks/llamacpp_gpu.py does the measuring).
#
#   here:  bash benchmarks/llamacpp_gpu.sh pack [SRC_OR_TARBALL] [OUT.tar.gz]
#            a slim llama.cpp source tarball to carry (~10 MB: the sdist is 76 MB, over the 64 MiB carry limit).
#            SRC_OR_TARBALL: a llama.cpp source tree or the llama-cpp-python sdist (default: the tree the CPU
#            build extracted from the pinned, sha256-checked sdist, ~/.cache/offload-tuner/llama.cpp-0.3.36-cpu/src);
#            OUT default build/llama.cpp-src.tar.gz (build/ is git-ignored).
#   there: bash benchmarks/llamacpp_gpu.sh build TARBALL [WORKDIR]
#            extract llama.cpp from TARBALL (the slim one, or the sdist: its vendor/llama.cpp) and build the CUDA
#            llama-bench + llama-fit-params (sm_90) in WORKDIR/llama.cpp-cuda (default WORKDIR
#            benchmarks/results/llamacpp_gpu); skipped when both binaries exist. ~6 min on 16 cores.
#          bash benchmarks/llamacpp_gpu.sh build-server TARBALL [WORKDIR]
#            the same, with llama-server too (benchmarks/workload_vs_fit.py serves the workload on it)
#          bash benchmarks/llamacpp_gpu.sh build-ik [TARBALL] [WORKDIR]
#            the CUDA ik_llama.cpp llama-bench, llama-sweep-bench and llama-cli (sm_90) from the pinned tarball
#            (default vendor/ik_llama.cpp-8337e4cd.tar.xz, which travels with the repository) in
#            WORKDIR/ik_llama.cpp-cuda; resumable: a run cut off by the 10-minute limit continues where it stopped
#            (the build folder is git-ignored and stays while the machine is held); skipped when
#            llama-sweep-bench exists (the GPU benchmarks run only it). ~18 min on 16 cores.
#          Both builds can come from an earlier machine with the same CPU: benchmarks/gpu_binaries.py (save / load)
#          bash benchmarks/llamacpp_gpu.sh run [ARGS...]     PYTHONPATH=. python3 benchmarks/llamacpp_gpu.py ARGS
#          bash benchmarks/llamacpp_gpu.sh run-ik [ARGS...]  PYTHONPATH=. python3 benchmarks/ik_gpu.py ARGS (after
#            build-ik; the ik memory table, -op on/off, the ik study against ik's --fit, mainline against it)
#          bash benchmarks/llamacpp_gpu.sh all TARBALL [ARGS...]   build, then run with the rest of a 480 s budget
#            (--time-budget 480 minus the build's seconds unless ARGS give one): one device command of <= 10 min
#
# What must be carried to the GPU machine: the repository as it travels (planner/, runtime/, benchmarks/) and
# the slim tarball (carry ["build/llama.cpp-src.tar.gz"]). Nothing else: python3 there has numpy and
# nvidia-ml-py; our code does not use the gguf package. Outputs: $OUT (or WORKDIR/report) gets the report;
# state (build, 17 GB model, per-plan results) stays in WORKDIR while the machine is held.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
WORKDIR_DEFAULT="$ROOT/benchmarks/results/llamacpp_gpu"
CPU_SRC="$HOME/.cache/offload-tuner/llama.cpp-0.3.36-cpu/src"
# Not needed to build llama-bench, llama-fit-params and llama-server with CUDA (tests and examples are off; the
# server's web UI is neither built nor downloaded: tools/ui's CMake writes a stand-in page without its sources).
EXCLUDE=(models docs media benches tests conversion gguf-py examples pocs app tools/ui/src tools/ui/static
         tools/ui/tests tools/ui/e2e
         tools/mtmd/legacy-models ggml/src/ggml-sycl ggml/src/ggml-vulkan ggml/src/ggml-opencl ggml/src/ggml-hexagon
         ggml/src/ggml-cann ggml/src/ggml-metal ggml/src/ggml-webgpu ggml/src/ggml-openvino ggml/src/ggml-et
         ggml/src/ggml-virtgpu ggml/src/ggml-musa ggml/src/ggml-zdnn ggml/src/ggml-zendnn .git .github)

log() { echo "[$(date +%H:%M:%S)] $*" >&2; }

# The folder inside TARBALL that holds llama.cpp's CMakeLists.txt (sdist: <name>/vendor/llama.cpp/).
llama_prefix() {
    local listing
    listing=$(tar -tzf "$1") || { log "cannot list $1"; return 1; }
    { grep -m1 -E '(^|/)(vendor/llama\.cpp|llama\.cpp)/CMakeLists\.txt$' <<<"$listing" || true; } \
        | sed 's#CMakeLists\.txt$##'
}

cmd_pack() {
    local src=${1:-$CPU_SRC} out=${2:-build/llama.cpp-src.tar.gz} tmp
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' RETURN
    if [[ -f "$src" ]]; then
        local prefix
        prefix=$(llama_prefix "$src")
        [[ -n "$prefix" ]] || { log "$src holds no llama.cpp tree"; return 1; }
        mkdir -p "$tmp/llama.cpp"
        tar -xzf "$src" -C "$tmp/llama.cpp" --strip-components="$(tr -cd / <<<"$prefix" | wc -c)" "$prefix"
        src="$tmp/llama.cpp"
    fi
    [[ -f "$src/CMakeLists.txt" && -d "$src/ggml/src/ggml-cuda" ]] || { log "$src is not a llama.cpp tree"; return 1; }
    if [[ "$(basename "$src")" != llama.cpp ]]; then
        # exclusions are anchored at the tree's own name: a tree called "src" would lose src/models
        ln -s "$(cd "$src" && pwd)" "$tmp/llama.cpp"
        src="$tmp/llama.cpp"
    fi
    local args=()
    for e in "${EXCLUDE[@]}"; do args+=(--exclude="$(basename "$src")/$e"); done
    mkdir -p "$(dirname "$out")"
    tar -czhf "$out" "${args[@]}" -C "$(dirname "$src")" --transform "s#^$(basename "$src")#llama.cpp#" "$(basename "$src")"
    log "wrote $out ($(du -h "$out" | cut -f1)); carry it: carry [\"$out\"]"
}

cmd_build() {
    local tarball=${1:?usage: build TARBALL [WORKDIR]} workdir=${2:-$WORKDIR_DEFAULT}
    local dir="$workdir/llama.cpp-cuda"
    local bin="$dir/build/bin"
    local targets=(llama-bench llama-fit-params ${BUILD_SERVER:+llama-server})
    local missing=()
    for t in "${targets[@]}"; do [[ -x "$bin/$t" ]] || missing+=("$t"); done
    if [[ ${#missing[@]} -eq 0 ]]; then
        log "build: $bin has ${targets[*]}, skipped"
        return 0
    fi
    if [[ ! -f "$dir/src/CMakeLists.txt" ]]; then
        local prefix
        prefix=$(llama_prefix "$tarball")
        [[ -n "$prefix" ]] || { log "$tarball holds no llama.cpp tree"; return 1; }
        rm -rf "$dir/src.tmp" && mkdir -p "$dir/src.tmp"
        tar -xzf "$tarball" -C "$dir/src.tmp" --strip-components="$(tr -cd / <<<"$prefix" | wc -c)" "$prefix"
        mv "$dir/src.tmp" "$dir/src"
    fi
    command -v nvcc >/dev/null || export PATH="/usr/local/cuda/bin:$PATH"
    local gen=()
    command -v ninja >/dev/null && gen=(-G Ninja)
    # no AMX: ggml's AMX path segfaults on Q8_0/Q4_0 prompt processing on some Xeons (docs/llamacpp.md section 10)
    local noamx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    log "build: cmake configure (CUDA, sm_90)"
    cmake -S "$dir/src" -B "$dir/build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON \
        -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=ON -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
        -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_SERVER="$([[ -n ${BUILD_SERVER:-} ]] && echo ON || echo OFF)" -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
        -DLLAMA_BUILD_APP=OFF -DCMAKE_C_FLAGS="$noamx" -DCMAKE_CXX_FLAGS="$noamx" >"$dir/configure.log" 2>&1 \
        || { tail -40 "$dir/configure.log"; return 1; }
    log "build: ${missing[*]} with -j$(nproc)"
    cmake --build "$dir/build" --config Release -j "$(nproc)" --target "${missing[@]}" \
        >"$dir/build.log" 2>&1 || { tail -60 "$dir/build.log"; return 1; }
    "$bin/llama-bench" --list-devices || true
    log "build: done: $bin"
}

cmd_build_ik() {
    local tarball=${1:-$ROOT/vendor/ik_llama.cpp-8337e4cd.tar.xz} workdir=${2:-$WORKDIR_DEFAULT}
    local dir="$workdir/ik_llama.cpp-cuda"
    local bin="$dir/build/bin"
    # the GPU benchmarks run sweep-bench alone (benchmarks/gpu_binaries.py load brings only it to a new machine)
    if [[ -x "$bin/llama-sweep-bench" ]]; then
        log "build-ik: $bin has llama-sweep-bench, skipped"
        return 0
    fi
    # the same patched tree as the CPU build of the tests (runtime/ik_build.py: examples pruned, version 4840)
    PYTHONPATH="$ROOT" python3 -m runtime.ik_build --source "$dir" "$tarball" >/dev/null
    command -v nvcc >/dev/null || export PATH="/usr/local/cuda/bin:$PATH"
    local gen=()
    command -v ninja >/dev/null && gen=(-G Ninja)
    if [[ ! -f "$dir/build/CMakeCache.txt" ]]; then
        log "build-ik: cmake configure (CUDA, sm_90)"
        # -O3 (Release) here: these binaries are measured. GGML_IQK_FA_ALL_QUANTS=OFF only trims the CPU
        # flash-attention kernels to f16/bf16/q8_0/q6_0 KV; GGML_NCCL=OFF: one host, no NCCL needed.
        cmake -S "$dir/src" -B "$dir/build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON \
            -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF \
            -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DGGML_CCACHE=OFF -DGGML_NCCL=OFF \
            -DGGML_IQK_FA_ALL_QUANTS=OFF >"$dir/configure.log" 2>&1 || { tail -40 "$dir/configure.log"; return 1; }
    fi
    log "build-ik: llama-bench llama-sweep-bench llama-cli with -j$(nproc)"
    cmake --build "$dir/build" --config Release -j "$(nproc)" --target llama-bench llama-sweep-bench llama-cli \
        >>"$dir/build.log" 2>&1 || { tail -60 "$dir/build.log"; return 1; }
    "$bin/llama-cli" --version || true
    log "build-ik: done: $bin"
}

cmd_run() {
    export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
    python3 "$ROOT/benchmarks/llamacpp_gpu.py" "$@"
}

cmd_run_ik() {
    export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
    python3 "$ROOT/benchmarks/ik_gpu.py" "$@"
}

case "${1:-}" in
    pack) shift; cmd_pack "$@" ;;
    build) shift; cmd_build "$@" ;;
    build-server) shift; BUILD_SERVER=1 cmd_build "$@" ;;
    build-ik) shift; cmd_build_ik "$@" ;;
    run) shift; cmd_run "$@" ;;
    run-ik) shift; cmd_run_ik "$@" ;;
    all) shift; t=${1:?usage: all TARBALL [ARGS...]}; shift; cmd_build "$t"
         if [[ " $* " == *" --time-budget "* ]]; then cmd_run "$@"; else cmd_run --time-budget $((480 - SECONDS)) "$@"; fi ;;
    *) sed -n '2,27p' "$0"; exit 2 ;;
esac
