#!/usr/bin/env bash
# The GPU check: one script, under 8 minutes on one H200 from a cold start (Triton and Inductor
# caches empty), with the machine's own python3 (torch 2.11 / triton 3.6 there: nothing newer is used).
#
#   OUT=/tmp/out bash bench/gpu_check.sh                      # from the repository root
#   GPU_CHECK_DRY=1 OUT=/tmp/dry bash bench/gpu_check.sh      # CPU dry run, tiny shapes (~15 s)
#
# Steps and their time limits (seconds; a step past its limit gets SIGTERM, SIGKILL 10 s later;
# the limits of the sequential steps sum to 420 s, which leaves 60 s of the 8 minutes for the
# header, the verdict and a step slow to die):
#   tests      100  tests/test_kernels.py, test_logit_max.py, test_momentum.py, test_moment_bound.py and
#                   test_signal.py on the GPU (TRITON_INTERPRET unset); the cold Triton compiles and the
#                   autotuning of the tests' sizes happen here
#   (aot)     (100) tests/test_aot_compile.py if present: CPU builds, in parallel with `tests`
#                   and under the same limit, joined before the benches (no extra time)
#   kernels     55  bench/kernels.py, all bf16 rows, then fp32 (a slow run loses fp32 rows first)
#   step_time   65  bench/step_time.py: the Muon step against forward+backward of 64 x 1024
#                   tokens, GPT-2 small; hetero then plain Muon; kernels auto/torch x clip auto/eigh
#   optimizer   45  bench/optimizer.py: published algorithm vs ours, GPT-2 small banks, bf16
#   train      125  train_gpt2.py: 200 steps of compiled bf16 GPT-2 small, hetero, the trainer's
#                   default batch (64 x 1024 tokens per step), on learnable synthetic tokens
#                   (data/make_synthetic_shards.py --mode pattern, written in the background)
#   fsdp        30  train_gpt2.py --fsdp: 3 eager steps of the same, in one process (FSDP2 over a
#                   1-rank NCCL group: the sharded path's code, not its scaling), checkpoint included
#
# Everything goes to $OUT as soon as it exists; at most 7 files (the device tool returns 8):
#   gpu_check.log        everything printed, the header included
#   summary.txt          header (GPU, versions, git rev), each step's exit status and seconds,
#                        then the verdict (figures picked from the files below)
#   kernels.json, step_time.json, optimizer.json   rewritten after every measurement
#   train_metrics.jsonl  copied every 10 s while training, then at the end
#   train_summary.json   the trainer's summary (status, losses, peak_memory_gb, wall_s)
# A failing step does not stop the others; the exit status is 1 if any step failed.
# Triton autotuning results are cached on disk (TRITON_CACHE_AUTOTUNING=1), so only the first
# process to meet a problem size benchmarks its configurations.
set -uo pipefail
OUT=${OUT:-bench/gpu_check_out}
PYTHON=${PYTHON:-python3}
DRY=${GPU_CHECK_DRY:-0}
WORK=${GPU_CHECK_WORK:-/tmp/gpu_check_work}  # shards and the run folder (checkpoints: not under $OUT)
mkdir -p "$OUT" "$WORK"
LOG=$OUT/gpu_check.log
SUMMARY=$OUT/summary.txt
: > "$LOG"
: > "$SUMMARY"
rm -f "$OUT"/{kernels,step_time,optimizer}.json "$OUT"/train_metrics.jsonl "$OUT"/train_summary.json  # a reused $OUT
unset TRITON_INTERPRET
export PYTHONUNBUFFERED=1 TRITON_CACHE_AUTOTUNING=1 TRITON_PRINT_AUTOTUNING=1
if [[ $DRY == 1 ]]; then
    export CUDA_VISIBLE_DEVICES="" OMP_NUM_THREADS=1  # the plumbing on CPU, even on a GPU machine
fi
copier=

cleanup() {
    [[ -n $copier ]] && kill "$copier" 2>/dev/null
    rm -f "$OUT"/*.tmp "$OUT"/.*.tmp
}
trap cleanup EXIT
trap 'exit 143' TERM INT

step() {  # step NAME LIMIT COMMAND...: time-limited; output to stdout and $STEP_LOG (default
          # the log) and $WORK/NAME.log; its exit status and seconds to the summary
    local name=$1 limit=$2 log=${STEP_LOG:-$LOG}
    shift 2
    echo "== $name (limit ${limit}s): $*" | tee -a "$log"
    local t0=$SECONDS
    timeout -k 10 "$limit" "$@" 2>&1 | tee "$WORK/$name.log" | tee -a "$log"
    local status=${PIPESTATUS[0]} note=""
    if [[ $status == 124 || $status == 137 ]]; then note=" (time limit)"; fi
    printf '%-10s exit %3s after %4ss%s\n' "$name" "$status" "$(( SECONDS - t0 ))" "$note" | tee -a "$log" "$SUMMARY"
}

# --- header ----------------------------------------------------------------------------------
{
    echo "gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ) host $(hostname) dry=$DRY"
    if command -v nvidia-smi > /dev/null; then
        nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
    else
        echo "nvidia-smi: not available"
    fi
    "$PYTHON" -c "
import sys, numpy, torch
try:
    import triton; tv = triton.__version__
except ImportError:
    tv = 'none'
gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA device'
print('python', sys.version.split()[0], '| torch', torch.__version__, '| cuda', torch.version.cuda,
      '| triton', tv, '| numpy', numpy.__version__, '|', gpu)" 2>&1
    rev=$(git rev-parse --short HEAD 2>/dev/null || echo n/a)
    echo "git $rev ($(git status --porcelain 2>/dev/null | wc -l) files changed or untracked)"
    echo "cpus $(getconf _NPROCESSORS_ONLN); budget 420 s of steps"
} 2>&1 | tee -a "$LOG" "$SUMMARY"

# --- per-mode settings -------------------------------------------------------------------------
if [[ $DRY == 1 ]]; then
    SHARD_TOKENS=300000
    TESTS=(--collect-only)  # the plumbing only: the kernel tests under the interpreter take minutes
    KERNELS=(--dtypes bf16 --banks attn.c_proj --ops msign)
    STEP_TIME=(--n-layer 1 --n-embd 32 --n-head 2 --batch 2 --micro-batch 1 --seq-len 16 --kernels torch
               --clips auto --repeat 1)
    OPTIMIZER=(--n-embd 32 --n-layer 1 --device cpu --steps 1 --warmup 1)
    TRAIN=(--n-layer 1 --n-head 2 --n-embd 32 --seq-len 32 --total-batch-size 2 --batch-size 1 --device cpu
           --max-steps 12 --warmup-steps 2 --eval-every 6 --eval-tokens 1024 --log-every 3)
    FSDP=("${TRAIN[@]}" --max-steps 3 --eval-every 3)
else
    SHARD_TOKENS=16000000  # 200 steps x 64 x 1024 = 13.1M: one pass, nothing repeated
    TESTS=()
    KERNELS=(--dtypes bf16,fp32 --rep-ms 50)
    STEP_TIME=(--kernels auto torch --clips auto eigh --cuda-graph)
    OPTIMIZER=(--n-embd 768 --n-layer 12 --device cuda --steps 2 --warmup 1)
    TRAIN=(--max-steps 200 --warmup-steps 20 --compile --eval-every 100 --eval-tokens 65536 --log-every 10)
    FSDP=(--max-steps 3 --warmup-steps 1 --eval-every 3 --eval-tokens 8192 --log-every 1)
fi

# the training data, written on the CPU while the GPU steps run
"$PYTHON" -m data.make_synthetic_shards "$WORK/shards" --tokens "$SHARD_TOKENS" --mode pattern \
    > "$WORK/shards.log" 2>&1 &
shards=$!

# --- steps -------------------------------------------------------------------------------------
PYTEST=("$PYTHON" -m pytest -q -o addopts= -p no:cacheprovider --timeout 60 -rfE --durations=5 ${TESTS[@]+"${TESTS[@]}"})
aot=
if [[ -f tests/test_aot_compile.py ]]; then  # CPU builds (2 workers): beside the GPU tests, output held back
    STEP_LOG=$WORK/aot.held step aot 100 "${PYTEST[@]}" tests/test_aot_compile.py > /dev/null &
    aot=$!
fi
step tests 100 "${PYTEST[@]}" tests/test_kernels.py tests/test_logit_max.py tests/test_momentum.py tests/test_moment_bound.py tests/test_signal.py
if [[ -n $aot ]]; then  # joined before the benches, whose eager timings include host work
    wait "$aot"
    tee -a "$LOG" < "$WORK/aot.held"
fi
step kernels 55 "$PYTHON" -m bench.kernels "${KERNELS[@]}" --out "$OUT/kernels.json"
step step_time 65 "$PYTHON" -m bench.step_time --assign hetero unconstrained "${STEP_TIME[@]}" \
    --out "$OUT/step_time.json"
step optimizer 45 "$PYTHON" -m bench.optimizer --assign hetero --dtype bfloat16 "${OPTIMIZER[@]}" \
    --out "$OUT/optimizer.json"

wait "$shards" || echo "make_synthetic_shards failed" | tee -a "$LOG" "$SUMMARY"
tee -a "$LOG" < "$WORK/shards.log"
RUN=$WORK/run
rm -rf "$RUN"
( while sleep 10; do  # the metrics so far, in case the whole check is cut short
      cp "$RUN/metrics.jsonl" "$OUT/.train_metrics.tmp" 2>/dev/null \
          && mv -f "$OUT/.train_metrics.tmp" "$OUT/train_metrics.jsonl"
  done ) &
copier=$!
step train 125 "$PYTHON" train_gpt2.py --data-dir "$WORK/shards" --out-dir "$RUN" --assign hetero \
    --ckpt-every 0 --overwrite "${TRAIN[@]}"
kill "$copier" 2>/dev/null
wait "$copier" 2>/dev/null
copier=
cp "$RUN/metrics.jsonl" "$OUT/train_metrics.jsonl" 2>/dev/null
cp "$RUN/summary.json" "$OUT/train_summary.json" 2>/dev/null
rm -rf "$RUN"  # the checkpoints (GBs)
step fsdp 30 "$PYTHON" train_gpt2.py --fsdp --data-dir "$WORK/shards" --out-dir "$WORK/fsdp" --assign hetero \
    --overwrite "${FSDP[@]}"
rm -rf "$WORK/fsdp"

# --- verdict -----------------------------------------------------------------------------------
"$PYTHON" - "$OUT" "$WORK" <<'EOF' 2>&1 | tee -a "$LOG" "$SUMMARY"
import json, math, os, statistics, sys

out, work = sys.argv[1], sys.argv[2]


def load(name):
    path = os.path.join(out, name)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        if not name.endswith(".jsonl"):
            return json.load(f)
        rows = []
        for line in f:
            try:
                rows.append(json.loads(line))
            except ValueError:  # a last line cut by a kill
                pass
        return rows


def section(title, fn):
    try:
        fn()
    except Exception as err:  # one missing or odd file must not hide the other figures
        print(f"{title}: no verdict ({type(err).__name__}: {err})")


def tests():
    for name in ("tests", "aot"):  # pytest's last line: "N passed, M failed in S s" (or collected)
        path = os.path.join(work, f"{name}.log")
        if os.path.exists(path):
            lines = [l.strip() for l in open(path) if any(w in l for w in (" passed", " failed", " error",
                                                                           " collected", " skipped"))]
            print(f"{name}:", lines[-1] if lines else "no pytest summary line")


def kernels():
    data = load("kernels.json")
    if data is None or not data["rows"]:
        print("kernels: no rows")
        return
    for r in data["rows"]:
        if "error" in r:
            print(f"kernels: {r['op']} {r['bank']} {r['dtype']} FAILED {r['error']}")
            continue
        target = f" target {r['target']:.1f}x" if r["target"] else ""
        met = "" if not r["target"] else (" met" if r["graph_speedup"] >= r["target"] else " MISSED")
        print(f"kernels: {r['op']:7s} {r['bank']:11s} {r['dtype']:4s} speedup eager {r['eager_speedup']:5.2f}x "
              f"graph {r['graph_speedup']:5.2f}x{target}{met} err {r['max_rel_err']:.1e}")


def step_time():
    data = load("step_time.json")
    for assign, res in data.items():
        if not isinstance(res, dict) or "forward_backward_ms" not in res:
            continue
        fb = res["forward_backward_ms"]
        for name, r in res.items():
            if isinstance(r, dict):
                figure = (f"FAILED {r['error']}" if "error" in r else
                          f"Muon {r['muon_step_ms']:7.1f} ms = {100 * r['ratio']:5.1f}% of fwd+bwd {fb:.0f} ms")
                if "graph_ms" in r:
                    figure += (f"; CUDA graph {r['graph_ms']:7.1f} ms = {100 * r['graph_ratio']:5.1f}%"
                               f" (vs eager {r['graph_max_abs_diff']:.1e})")
                elif "graph_error" in r:
                    figure += f"; CUDA graph FAILED {r['graph_error']}"
                print(f"step_time: {assign:13s} {name:11s} {figure}")


def optimizer():
    data = load("optimizer.json")
    s, x = data.get("seconds_per_step", {}), data.get("speedup_vs_published", {})
    print("optimizer: " + ", ".join(f"{k} {1000 * v:.1f} ms" + (f" ({x[k]:.1f}x)" if k in x else "")
                                    for k, v in s.items()))


def train():
    rows, summary = load("train_metrics.jsonl"), load("train_summary.json")
    if not rows:
        print("train: no metrics")
        return
    steps = [r for r in rows if "train_loss" in r]
    evals = [r for r in rows if "val_loss" in r]
    losses = [r["train_loss"] for r in steps]
    bad = [r["step"] for r in steps + evals
           if not math.isfinite(r.get("train_loss", 0.0)) or not math.isfinite(r.get("val_loss", 0.0) or 0.0)]
    timed = steps[10:] or steps  # the first steps include compilation
    val = " -> ".join("%.3f" % r["val_loss"] for r in evals) or "none"
    print(f"train: {len(steps)} steps, train loss {losses[0]:.3f} -> {losses[-1]:.3f} "
          f"({'falls' if losses[-1] < losses[0] - 0.5 else 'DOES NOT FALL'}), val {val}, "
          f"{'NaN/inf at steps ' + str(bad[:5]) if bad else 'no NaN'}")
    step_ms, opt_ms = (statistics.median(r[k] for r in timed) for k in ("step_ms", "opt_ms"))
    print(f"train: median {statistics.median(r['tokens_per_s'] for r in timed):,.0f} tokens/s, step {step_ms:.0f} ms, "
          f"optimizer {opt_ms:.0f} ms = {100 * opt_ms / (step_ms - opt_ms):.0f}% of the rest (forward+backward, "
          f"clipping, data), steps {timed[0]['step']}+")
    if summary:
        peak = summary.get("peak_memory_gb")
        print(f"train: status {summary['status']}, wall {summary['wall_s']:.0f} s, peak memory "
              + (f"{peak:.1f} GiB" if peak is not None else "n/a (no CUDA, or not reported)"))
    else:
        print("train: no summary.json (cut short?)")


for title, fn in (("tests", tests), ("kernels", kernels), ("step_time", step_time),
                  ("optimizer", optimizer), ("train", train)):
    section(title, fn)
EOF
echo "total ${SECONDS}s; files in \$OUT: $(ls "$OUT" | tr '\n' ' ')" | tee -a "$LOG" "$SUMMARY"
! grep -qE '^[a-z_]+ +exit +[1-9]' "$SUMMARY"  # the exit status: 1 if any step failed
