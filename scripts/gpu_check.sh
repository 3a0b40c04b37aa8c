#!/usr/bin/env bash
# The device check, in one command on a CUDA machine without internet, from the repository root:
#
#     bash scripts/gpu_check.sh
#
# 0. environment: a venv over the system python's packages (torch with CUDA must be there already), batchgen
#    installed editable, wheels from ./wheels (or ./.whl) installed offline (flashinfer-python and apache-tvm-ffi:
#    see the end of this comment), FlashInfer's one JIT module built and timed;
# a. pytest -m cuda (tests/gpu/test_cuda.py): kernels, CUDA-graph hooks, backends agree on a tiny model;
#    tests/gpu/test_cuda_deterministic.py: --deterministic's batch-invariant GEMM and attention compiled, and
#    byte-identical rows across batch sizes, chunking, prefix cache, speculative decoding and CUDA graphs;
# b. scripts/gpu_check.py compare: greedy tokens and logprobs of random:llama-1b across torch_native / triton /
#    flashinfer, CUDA graphs on/off and the fused elementwise kernels (BATCHGEN_TRITON_FUSED_OPS=1) (float32:
#    identical tokens, |dlogprob| <= 1e-4; bfloat16: against float32, within torch_native bfloat16's rounding
#    noise, see gpu_check.py);
# c. scripts/gpu_check.py bench: bench-one-batch (bf16, batch 1 8 64, input 512, output 64) eager, with CUDA
#    graphs, and with graphs and the fused elementwise kernels: decode ms/step, tok/s, achieved GB/s against the
#    measured copy bandwidth, and each switch's speedup;
# d. batchgen bench --baseline hf hf-cb: offline throughput of random:llama-1b (bf16, 256 prompts of 32-256
#    tokens, 64 new tokens) beside HF transformers generate and generate_batch in the same process, the ratios;
# e. batchgen bench --speculative-algorithm ngram --baseline plain: n-gram speculative decoding against plain
#    decoding on a repetitive workload of random:llama-1b, with the acceptance figures (into bench_hf.jsonl too).
#
# Each step reports PASS/FAIL and runs whatever happened before; the script exits non-zero if any failed. A step
# still running at its time limit gets SIGABRT, on which Python prints its threads' stacks.
# Everything printed also goes to $OUT/gpu_check.log (or ./gpu_check_out/ when OUT is unset), with
# $OUT/summary.txt, compare.json, bench.jsonl, bench_table.txt and bench_hf.jsonl. On one H200 (2026-11-29) steps
# 0-d took about 5 minutes after the machine's start (before the fused-kernel runs and step e were added),
# FlashInfer's JIT build 14-20 s of it;
# GPU_CHECK_BUDGET (seconds, default 470) caps the whole run, each step getting what is left.
#
# Knobs: GPU_CHECK_STEPS (the steps to run, default "0 a b c d e"), PYTHON (the interpreter holding torch; default
# python3), GPU_CHECK_VENV (default /tmp/batchgen-gpu-venv), GPU_CHECK_BENCH_BACKENDS (default "auto"; e.g.
# "flashinfer triton" to compare), GPU_CHECK_COMPARE_ONLY (step b's runs to check, e.g.
# "bfloat16/flashinfer/graphs/fused"; the float32 reference and the bfloat16 noise run always run; default all).
#
# Wheels for a machine without internet (Python 3.12, x86-64), fetched where pip works:
#     pip download --no-deps -d wheels flashinfer-python==0.5.3
#     pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#         --platform manylinux_2_28_x86_64 -d wheels "apache-tvm-ffi>=0.1,<0.2"
# flashinfer's other import-time needs (numpy, einops, tabulate, nvidia-ml-py, packaging, requests, click, tqdm,
# filelock) and its JIT's (ninja, nvcc) are assumed present; nvidia-cutlass-dsl and nvidia-cudnn-frontend are
# only for kernels batchgen does not use.

set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT_DIR="${OUT:-$PWD/gpu_check_out}"
mkdir -p "$OUT_DIR"
exec > >(tee "$OUT_DIR/gpu_check.log") 2>&1
: >"$OUT_DIR/summary.txt"
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

BUDGET="${GPU_CHECK_BUDGET:-470}"
DEADLINE=$((SECONDS + BUDGET))
read -r -a STEPS <<<"${GPU_CHECK_STEPS:-0 a b c d e}"
declare -A RESULT=()
# Seconds each step would like, and the least it is given (kept in reserve while earlier steps run).
declare -A WANT=([0]=200 [a]=150 [b]=150 [c]=150 [d]=150 [e]=90) LEAST=([0]=60 [a]=60 [b]=110 [c]=80 [d]=90 [e]=60)

banner() { printf '\n===== %s  (%ds elapsed, %ds left) =====\n' "$1" "$SECONDS" $((DEADLINE - SECONDS)); }
wanted() { [[ " ${STEPS[*]} " == *" $1 "* ]]; }

# Seconds for step $1: what it wants, less the least of each wanted step after it, and never below its own least.
step_time() {
    local step=$1 reserve=0 later=0 s
    for s in 0 a b c d e; do
        ((later)) && wanted "$s" && reserve=$((reserve + LEAST[$s]))
        [[ $s == "$step" ]] && later=1
    done
    local want=${WANT[$step]} left=$((DEADLINE - SECONDS - reserve))
    ((left < want)) && want=$left
    ((want < LEAST[$step])) && want=${LEAST[$step]}
    echo "$want"
}

# Run a step, record PASS/FAIL (never stop the script: the later steps still run). At its time limit the step
# gets SIGABRT, on which Python (PYTHONFAULTHANDLER) prints every thread's stack: where it hung.
run_step() {
    local name=$1 seconds=$2
    shift 2
    local rc=0
    timeout --signal=ABRT --kill-after=15 "$seconds" "$@" || rc=$?
    if ((rc == 0)); then
        RESULT[$name]=PASS
    elif ((rc == 124 || rc == 137)); then
        RESULT[$name]="FAIL (timed out after ${seconds}s)"
    else
        RESULT[$name]="FAIL (exit $rc)"
    fi
    echo "----- $name: ${RESULT[$name]}"
}

# A command prefix: each line of the command's output stamped with the wall-clock time; the command's exit status.
# The stamping loop ignores SIGABRT so that it still passes on the stacks a timed-out command prints.
STAMPED=(bash -c 'set -o pipefail; "$@" 2>&1 | { trap "" ABRT; while IFS= read -r l; do printf "%(%T)T %s\n" -1 "$l"; done; }' stamped)

# ---- 0. environment ----
banner "0. environment"
PY="${PYTHON:-python3}"
"$PY" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, "CUDA", torch.version.cuda,
"available:", torch.cuda.is_available())'
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "FAIL: $PY's torch sees no CUDA GPU; nothing to check"
    exit 1
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true

# A venv that sees the system packages through a .pth file: --system-site-packages would not, when python3 is
# itself a venv (as on the device image), since it exposes only the base interpreter's packages.
VENV="${GPU_CHECK_VENV:-/tmp/batchgen-gpu-venv}"
if [[ ! -x "$VENV/bin/python" ]] && "$PY" -m venv --without-pip "$VENV"; then
    "$PY" -c 'import site; print("\n".join(site.getsitepackages()))' \
        >"$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_system_site.pth"
fi
VPY="$VENV/bin/python"
if [[ ! -x "$VPY" ]]; then
    echo "WARNING: no venv at $VENV; installing into $PY's environment instead"
    VPY="$PY"
fi
# The interpreter's own bin (ninja, nvcc wrappers pip installed) for FlashInfer's JIT, then the venv's.
PY_BIN="$("$PY" -c 'import os, sys; print(os.path.join(sys.prefix, "bin"))')"
export PATH="$VENV/bin:$PY_BIN:$PATH"
if ! command -v nvcc >/dev/null && [[ -x /usr/local/cuda/bin/nvcc ]]; then
    export PATH="/usr/local/cuda/bin:$PATH"
fi
echo "nvcc: $(command -v nvcc || echo 'MISSING: FlashInfer cannot build its kernels')"
echo "ninja: $(command -v ninja || echo 'MISSING: FlashInfer cannot build its kernels')"

for dir in wheels .whl; do
    if compgen -G "$dir/*.whl" >/dev/null; then
        echo "installing offline:" "$dir"/*.whl
        "$VPY" -m pip install -q --no-index --no-deps --no-cache-dir "$dir"/*.whl ||
            echo "WARNING: installing the wheels in $dir failed; steps that need them will fail"
    fi
done
if ! "$VPY" -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir -e .; then
    echo "WARNING: editable install failed; using PYTHONPATH=$PWD instead"
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
"$VPY" -c 'import batchgen, pathlib; print("batchgen from", pathlib.Path(batchgen.__file__).parent)'
if wanted 0; then
    run_step "0. flashinfer JIT warm-up" "$(step_time 0)" "$VPY" scripts/gpu_check.py warmup --out-dir "$OUT_DIR"
fi

# ---- a. pytest -m cuda ----
if wanted a; then
    banner "a. pytest -m cuda"
    mapfile -t CUDA_TESTS < <(grep -l "pytest.mark.cuda" tests/*/test_*.py)
    echo "test files with cuda tests: ${CUDA_TESTS[*]}"
    # Only those files are collected: the others may import packages the GPU image lacks (jsonschema).
    # -rP: the passing tests' output too (the bfloat16 test prints each backend's distance from float32).
    run_step "a. pytest -m cuda" "$(step_time a)" \
        "$VPY" -m pytest -m cuda -q -rP -p no:cacheprovider "${CUDA_TESTS[@]}"
fi

# ---- b. greedy agreement on random:llama-1b ----
if wanted b; then
    banner "b. backends and CUDA graphs agree (random:llama-1b)"
    B_TIME="$(step_time b)"
    read -r -a COMPARE_ONLY <<<"${GPU_CHECK_COMPARE_ONLY:-}"
    run_step "b. greedy agreement" "$B_TIME" "$VPY" scripts/gpu_check.py compare --out-dir "$OUT_DIR" \
        --timeout $((B_TIME - 20)) --only "${COMPARE_ONLY[@]}"
fi

# ---- c. bench-one-batch ----
if wanted c; then
    banner "c. bench-one-batch, CUDA graphs on and off"
    C_TIME="$(step_time c)"
    read -r -a BENCH_BACKENDS <<<"${GPU_CHECK_BENCH_BACKENDS:-auto}"
    run_step "c. bench-one-batch" "$C_TIME" "$VPY" scripts/gpu_check.py bench --out-dir "$OUT_DIR" \
        --timeout $((C_TIME - 20)) --backends "${BENCH_BACKENDS[@]}"
fi

# ---- d. offline throughput beside HF generate ----
if wanted d; then
    banner "d. bench --baseline hf hf-cb (random:llama-1b)"
    run_step "d. bench vs HF generate" "$(step_time d)" "${STAMPED[@]}" \
        "$VPY" -m batchgen bench --model random:llama-1b --device cuda --dtype bfloat16 --num-prompts 256 \
        --input-len-range 32:256 --output-len 64 --baseline hf --baseline hf-cb --hf-batch-size 64 \
        --result-file "$OUT_DIR/bench_hf.jsonl"
fi

# ---- e. speculative decoding against plain decoding ----
if wanted e; then
    banner "e. bench --speculative-algorithm ngram --baseline plain (random:llama-1b)"
    run_step "e. speculative vs plain" "$(step_time e)" "${STAMPED[@]}" \
        "$VPY" -m batchgen bench --model random:llama-1b --device cuda --dtype bfloat16 --num-prompts 64 \
        --input-len-range 64:256 --output-len 128 --repetitive --speculative-algorithm ngram --baseline plain \
        --result-file "$OUT_DIR/bench_hf.jsonl"
fi

# ---- summary ----
banner "summary"
status=0
for name in "0. flashinfer JIT warm-up" "a. pytest -m cuda" "b. greedy agreement" "c. bench-one-batch" \
    "d. bench vs HF generate" "e. speculative vs plain"; do
    wanted "${name%%.*}" || RESULT[$name]="skipped (GPU_CHECK_STEPS)"
    printf '%-28s %s\n' "$name" "${RESULT[$name]:-not run}" | tee -a "$OUT_DIR/summary.txt"
    [[ "${RESULT[$name]:-}" == PASS || "${RESULT[$name]:-}" == skipped* ]] || status=1
done
exit "$status"
