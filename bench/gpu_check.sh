#!/usr/bin/env bash
# One GPU check of the fused Triton kernels (issue 4), about 3-4 minutes on an H200:
#   1. tests/test_kernels.py with the kernels compiled for the GPU (TRITON_INTERPRET unset)
#   2. bench/kernels.py in bf16 (the targets), then in fp32 (the optimizer's dtype)
# Run from the repository root; logs and JSON go to $OUT (default bench/gpu_check_out).
#   OUT=/tmp/out bash bench/gpu_check.sh
# Each step has a time limit, so the whole check stays under 4 minutes even when a step hangs;
# the bench rewrites its JSON after every row, so a cut-short bench still leaves its rows.
set -uo pipefail
OUT=${OUT:-bench/gpu_check_out}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
: > "$OUT/summary.txt"
unset TRITON_INTERPRET
start=$(date +%s)

step() {  # step NAME SECONDS COMMAND...: run with a time limit, tee the log, record the status
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit}s): $*" | tee "$OUT/$name.log"
    local t0=$(date +%s)
    timeout "$limit" "$@" 2>&1 | tee -a "$OUT/$name.log"
    local status=${PIPESTATUS[0]}
    echo "== $name: exit $status after $(( $(date +%s) - t0 ))s" | tee -a "$OUT/$name.log" "$OUT/summary.txt"
}

{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
    "$PYTHON" -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', torch.__version__, \
'cuda', torch.version.cuda, 'triton', triton.__version__, 'gpu', torch.cuda.get_device_name())"
    git rev-parse HEAD 2>/dev/null || true
} 2>&1 | tee "$OUT/env.txt"

step pytest 120 "$PYTHON" -m pytest -q -p no:cacheprovider --durations=10 tests/test_kernels.py
step bench_bf16 75 "$PYTHON" bench/kernels.py --dtypes bf16 --out "$OUT/bench_bf16.json"
step bench_fp32 40 "$PYTHON" bench/kernels.py --dtypes fp32 --out "$OUT/bench_fp32.json"
echo "total $(( $(date +%s) - start ))s" | tee -a "$OUT/summary.txt"
