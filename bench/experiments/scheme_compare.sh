#!/usr/bin/env bash
# The online solver scheme (one dual step per training step, the default since issue 49) against
# the ADMM scheme it replaced (--solver-opt scheme=admm), by training: the solver guard's model
# (2 layers x 64, 300 steps) and run.sh quick's (2 layers x 128, 200 steps) on the bundled books,
# hetero and all-dgram, 3 seeds, with what a GPU runs (polynomial clip, sync-free, TF32 emulated).
#   bash bench/experiments/scheme_compare.sh            (OUT, SEEDS, SCHEMES, ASSIGNS, SETTINGS, JOBS, VENV override)
#   SCHEMES="online:dual_step=0.1" ASSIGNS=hetero SETTINGS=guard bash bench/experiments/scheme_compare.sh   (a variant)
# Resumable: a run with a summary.json is skipped. Then: python -m tools.sweep_report / tools.stats.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-runs/scheme-compare}
SEEDS=${SEEDS:-"1 2 3"}
SCHEMES=${SCHEMES:-"online admm"}
ASSIGNS=${ASSIGNS:-"hetero all-dgram"}
SETTINGS=${SETTINGS:-"guard quick"}
JOBS=${JOBS:-2}
CORPUS=${CORPUS:-../shared/corpus}
PY=${VENV:-.venv}/bin/python
mkdir -p "$OUT"
if [ ! -f "$OUT/data/prepare_progress.json" ]; then
    $PY -m data.split_text "$CORPUS"/*.txt --out "$OUT/books.jsonl"
    $PY -m data.prepare --files "$OUT/books.jsonl" --out-dir "$OUT/data" --val-fraction 0.1 --num-proc 1
fi
declare -A MODEL=([guard]="--n-layer 2 --n-head 2 --n-embd 64 --max-steps 300 --eval-every 50"
                  [quick]="--n-layer 2 --n-head 4 --n-embd 128 --max-steps 200 --eval-every 50")
# one line: xargs -I reads one command per line
COMMON="--seq-len 128 --total-batch-size 8 --batch-size 8 --warmup-steps 20 --lr 3e-3 --min-lr 3e-4 --muon-lr 0.05"
COMMON+=" --eval-tokens 8192 --log-every 50 --device cpu --wandb off --solver-precision tf32"
COMMON+=" --solver-opt clip=polynomial --solver-opt capturable=on"
for setting in $SETTINGS; do
    for seed in $SEEDS; do
        for assign in $ASSIGNS; do
            for scheme in $SCHEMES; do
                # a scheme with options: online:dual_step=0.1,... (its folder: online-dual_step=0.1-...)
                opts="--solver-opt scheme=${scheme%%:*}"
                if [[ $scheme == *:* ]]; then
                    IFS=, read -ra extra <<< "${scheme#*:}"
                    for kv in "${extra[@]}"; do opts+=" --solver-opt $kv"; done
                fi
                dir="$OUT/$setting/${scheme//[:,]/-}/seed$seed/$assign"
                [ -f "$dir/summary.json" ] && continue
                mkdir -p "$(dirname "$dir")"
                echo "OMP_NUM_THREADS=1 $PY train_gpt2.py --assign $assign --data-dir $OUT/data --out-dir $dir --overwrite ${MODEL[$setting]} $COMMON $opts --seed $seed > $dir.log 2>&1 || echo failed: $dir"
            done
        done
    done
done | xargs -P "$JOBS" -I{} bash -c "{}"
