#!/usr/bin/env bash
# The online solver scheme (one dual step per training step, the default since issue 49) against
# the ADMM scheme it replaced (--solver-opt scheme=admm), by training: the solver guard's model
# (2 layers x 64, 300 steps) and run.sh quick's (2 layers x 128, 200 steps) on the bundled books,
# hetero and all-dgram, 3 seeds, with what a GPU runs (polynomial clip, sync-free, TF32 emulated).
#   bash bench/experiments/scheme_compare.sh            (OUT, SEEDS, SCHEMES, ASSIGNS, SETTINGS, JOBS, VENV override)
#   SCHEMES="online:dual_step=0.1" ASSIGNS=hetero SETTINGS=guard bash bench/experiments/scheme_compare.sh   (a variant)
#   EQUAL_TIME=online SCHEMES="online admm" bash bench/experiments/scheme_compare.sh   (equal estimated GPU time)
# EQUAL_TIME=<base scheme>: every other scheme runs the steps that take the base scheme's run time on
# one H200 (bench/experiments/equal_time.py, the cost model's ESTIMATE; EQUAL_TIME_RANKS for another
# world size) into a folder <scheme>-equal-time; the base scheme keeps its steps and folder.
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
declare -A MODEL=([guard]="--n-layer 2 --n-head 2 --n-embd 64 --eval-every 50"
                  [quick]="--n-layer 2 --n-head 4 --n-embd 128 --eval-every 50")
declare -A STEPS=([guard]=300 [quick]=200)
EQUAL_TIME=${EQUAL_TIME:-}
# steps <setting> <scheme>: the setting's steps, or the equal-time count against EQUAL_TIME
steps() {
    if [ -z "$EQUAL_TIME" ] || [ "$2" = "$EQUAL_TIME" ]; then echo "${STEPS[$1]}"; return; fi
    $PY -m bench.experiments.equal_time --steps "${STEPS[$1]}" --base "$EQUAL_TIME" --scheme "$2" \
        --world-size "${EQUAL_TIME_RANKS:-1}"
}
declare -A STEPS_OF  # setting/scheme -> steps, each counted once
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
                folder=${scheme//[:,]/-}
                if [ -n "$EQUAL_TIME" ] && [ "$scheme" != "$EQUAL_TIME" ]; then folder+="-equal-time"; fi
                dir="$OUT/$setting/$folder/seed$seed/$assign"
                [ -f "$dir/summary.json" ] && continue
                mkdir -p "$(dirname "$dir")"
                [ -n "${STEPS_OF[$setting/$scheme]:-}" ] || STEPS_OF[$setting/$scheme]=$(steps "$setting" "$scheme")
                n=${STEPS_OF[$setting/$scheme]}
                echo "OMP_NUM_THREADS=1 $PY train_gpt2.py --assign $assign --data-dir $OUT/data --out-dir $dir --overwrite ${MODEL[$setting]} --max-steps $n $COMMON $opts --seed $seed > $dir.log 2>&1 || echo failed: $dir"
            done
        done
    done
done | xargs -P "$JOBS" -I{} bash -c "{}"
