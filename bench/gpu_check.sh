#!/usr/bin/env bash
# One GPU check, under 10 minutes on an H200:
#   1. tests/test_kernels.py with the kernels compiled for the GPU (TRITON_INTERPRET unset)
#   2. bench/kernels.py in bf16 (the kernel issue's targets)
#   3. bench/step_time.py and bench/optimizer.py (optimizer cost against forward+backward and
#      against the published algorithm, GPT-2 small)
#   4. bench/throughput.py (whole steps: hetero vs plain Muon vs AdamW), then a 40-step GPT-2
#      small training run with --compile on random tokens (the GPU code path)
# Run from the repository root; logs and JSON go to $OUT (default bench/gpu_check_out).
#   OUT=/tmp/out bash bench/gpu_check.sh
# Each step has a time limit, so the whole check stays under 10 minutes even when a step hangs;
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

step pytest 100 "$PYTHON" -m pytest -q -p no:cacheprovider --durations=10 tests/test_kernels.py
step bench_bf16 70 "$PYTHON" bench/kernels.py --dtypes bf16 --out "$OUT/bench_bf16.json"
# issue 8: Muon step vs forward+backward of 64 x 1024 tokens, GPT-2 small; published vs ours
step step_time 130 "$PYTHON" bench/step_time.py --kernels auto torch --clips auto eigh --out "$OUT/step_time.json"
step optimizer 100 "$PYTHON" bench/optimizer.py --n-embd 768 --n-layer 12 --device cuda --dtype bfloat16 \
    --steps 2 --warmup 1 --out "$OUT/optimizer.json"
step throughput 50 "$PYTHON" bench/throughput.py --n-layer 12 --n-embd 768 --n-head 12 --batch 16 --seq-len 1024 \
    --rounds 3 --out "$OUT/throughput.json"
# the trainer's GPU path end to end: bf16 autocast, torch.compile, Triton kernels, checkpoint
"$PYTHON" bench/make_synthetic_shards.py /tmp/gpu_shards --tokens 4000000 > /dev/null
step train 130 "$PYTHON" train_gpt2.py --data-dir /tmp/gpu_shards --out-dir /tmp/gpu_run --assign hetero \
    --batch-size 16 --max-steps 40 --warmup-steps 5 --eval-every 20 --eval-tokens 131072 --log-every 5 \
    --ckpt-every 20 --compile --overwrite
cp /tmp/gpu_run/metrics.jsonl /tmp/gpu_run/summary.json "$OUT/" 2>/dev/null || true
echo "total $(( $(date +%s) - start ))s" | tee -a "$OUT/summary.txt"
