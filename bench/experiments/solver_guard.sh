#!/usr/bin/env bash
# Training-quality guard of the optimizer's cheap defaults: the default solver
# budget against the paper's 20 iterations, on a tiny GPT-2 (2 layers, width 64) trained for
# 300 steps on the bundled books (../shared/corpus), hetero and all-stiefel, two seeds, on CPU.
#   bash bench/experiments/solver_guard.sh          (SEEDS, CORPUS, OUT, VENV override the defaults)
#   SETTINGS="default iters20 warm2 warm4" ASSIGNS=hetero bash bench/experiments/solver_guard.sh
#     (warmN: N warm-started ADMM iterations)
#   SETTINGS="iters20 gpu gpu-fp32" ASSIGNS=hetero bash bench/experiments/solver_guard.sh
#     (gpu: what a GPU runs by default, the polynomial clip, sync-free, TF32 inner iterations
#     emulated on this CPU; gpu-fp32: the same at fp32; gpu-rho03/05: gpu with the warm ADMM
#     penalty 0.3 / 0.5 instead of the default; gpu-growth1: gpu with a constant warm penalty)
set -euo pipefail
cd "$(dirname "$0")/../.."
SEEDS=${SEEDS:-"1 2"}
CORPUS=${CORPUS:-../shared/corpus}
OUT=${OUT:-runs/solver-guard}
PY=${VENV:-.venv}/bin/python
mkdir -p "$OUT"
if [ ! -f "$OUT/data/prepare_progress.json" ]; then
    $PY -m data.split_text "$CORPUS"/*.txt --out "$OUT/books.jsonl"
    $PY -m data.prepare --files "$OUT/books.jsonl" --out-dir "$OUT/data" --val-fraction 0.1 --num-proc 1
fi
GPU="--solver-opt clip=polynomial --solver-opt capturable=on"
declare -A SOLVER=([default]="" [iters20]="--solver-opt iterations=20 --solver-opt pullbacks=0"
                   [warm1]="--solver-opt iterations=1" [warm2]="--solver-opt iterations=2"
                   [warm3]="--solver-opt iterations=3" [warm4]="--solver-opt iterations=4"
                   [gpu]="$GPU --solver-precision tf32"
                   [gpu-fp32]="$GPU --solver-precision fp32"
                   [gpu-rho03]="$GPU --solver-precision tf32 --solver-opt rho_warm=0.3"
                   [gpu-rho05]="$GPU --solver-precision tf32 --solver-opt rho_warm=0.5"
                   [gpu-growth1]="$GPU --solver-precision tf32 --solver-opt rho_growth=1")
SETTINGS=${SETTINGS:-"default iters20"}
ASSIGNS=${ASSIGNS:-"hetero all-stiefel"}
for setting in $SETTINGS; do
    [ -n "${SOLVER[$setting]+set}" ] || { echo "error: unknown setting $setting; valid: ${!SOLVER[*]}" >&2; exit 2; }
    for seed in $SEEDS; do
        for assign in $ASSIGNS; do
            dir="$OUT/$setting/seed$seed/$assign"
            [ -f "$dir/summary.json" ] && continue
            # shellcheck disable=SC2086
            $PY train_gpt2.py --assign "$assign" --data-dir "$OUT/data" --out-dir "$dir" --overwrite \
                --n-layer 2 --n-head 2 --n-embd 64 --seq-len 128 --total-batch-size 8 --batch-size 8 --max-steps 300 \
                --warmup-steps 20 --lr 3e-3 --min-lr 3e-4 --muon-lr 0.05 --eval-every 50 \
                --eval-tokens 8192 --log-every 50 --seed "$seed" --device cpu --wandb off \
                ${SOLVER[$setting]} "$@"
        done
    done
    $PY -m tools.report "$OUT/$setting"/seed* --out "$OUT/$setting"
done
# The figure compares the default against iters20; an OUT holding other settings only (a commit's
# gpu runs, compared with the iters20 figures of the guard) has nothing to plot
if compgen -G "$OUT/default/seed*/*/metrics.jsonl" > /dev/null || compgen -G "$OUT/iters20/seed*/*/metrics.jsonl" > /dev/null; then
    $PY -m bench.experiments.solver_guard_plot "$OUT"
else
    echo "no default or iters20 runs under $OUT: the reports above are the result (no guard figure)"
fi
