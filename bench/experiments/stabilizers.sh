#!/usr/bin/env bash
# Can DGram attention be stabilized? all-dgram at Muon lr 0.2 (where its attention
# saturates, docs/experiments.md) with each of the literature's stabilizers, against capped-DGram
# attention and hetero, on the bundled books (../shared/corpus), run.sh quick's model, on CPU.
#   bash bench/experiments/stabilizers.sh           (SEEDS, MUON_LR, JOBS, CORPUS, OUT, CONFIGS override the defaults)
#   CONFIGS="all-dgram qk-clip100" SEEDS=1337 bash bench/experiments/stabilizers.sh
# Runs go to $OUT/<config>/seed<seed>; finished ones are kept; the report is $OUT/report.md.
set -euo pipefail
cd "$(dirname "$0")/../.."
SEEDS=${SEEDS:-"1337 1338 1339"}
MUON_LR=${MUON_LR:-0.2}
JOBS=${JOBS:-2}
CORPUS=${CORPUS:-../shared/corpus}
OUT=${OUT:-runs/stabilizers}
PY=${VENV:-.venv}/bin/python
declare -A CONFIG=([all-dgram]="--assign all-dgram"
                   [qk-norm]="--assign all-dgram --qk-norm"
                   [qk-clip100]="--assign all-dgram --qk-clip 100"
                   [qk-clip10]="--assign all-dgram --qk-clip 10"
                   [softcap50]="--assign all-dgram --attn-softcap 50"
                   [dgram-cap]="--assign attn=dgram-cap,mlp=dgram"
                   [hetero]="--assign hetero")
CONFIGS=${CONFIGS:-"all-dgram qk-norm qk-clip100 softcap50 qk-clip10 dgram-cap hetero"}
# run.sh quick's model and schedule (QUICK in run.sh)
QUICK="--n-layer 2 --n-head 4 --n-embd 128 --seq-len 128 --total-batch-size 8 --batch-size 8 --max-steps 200
       --warmup-steps 20 --lr 3e-3 --min-lr 3e-4 --eval-every 25 --eval-tokens 8192 --log-every 25"
for config in $CONFIGS; do
    [ -n "${CONFIG[$config]+set}" ] || { echo "error: unknown config $config; valid: ${!CONFIG[*]}" >&2; exit 2; }
done
mkdir -p "$OUT"
if [ ! -f "$OUT/data/prepare_progress.json" ]; then
    $PY -m data.split_text "$CORPUS"/*.txt --out "$OUT/books.jsonl"
    $PY -m data.prepare --files "$OUT/books.jsonl" --out-dir "$OUT/data" --val-fraction 0.1 --num-proc 1
fi
# one line per run, seed-major (a stopped sweep has every config at its first seeds)
plan() {
    for seed in $SEEDS; do
        for config in $CONFIGS; do
            dir="$OUT/$config/seed$seed"
            [ -f "$dir/summary.json" ] && continue
            echo "$dir ${CONFIG[$config]} --seed $seed"
        done
    done
}
export PY QUICK MUON_LR OUT
plan | xargs -P "$JOBS" -L 1 bash -c '
    dir=$0; mkdir -p "$dir"; echo "== $dir"
    # shellcheck disable=SC2086
    OMP_NUM_THREADS=1 $PY train_gpt2.py $QUICK --muon-lr "$MUON_LR" --data-dir "$OUT/data" --out-dir "$dir" \
        --overwrite --device cpu --wandb off "$@" > "$dir/train.log" 2>&1 || echo "== $dir: status $?"'
$PY -m tools.report "$OUT"/*/seed* --out "$OUT"
