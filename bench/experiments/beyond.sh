#!/usr/bin/env bash
# The experiments of docs/experiments.md: at a Muon learning rate where all-dgram's attention
# saturates, compare hetero, hetero-qk, all-dgram, all-dgram with capped attention, and auto,
# over several seeds, on the bundled books (../shared/corpus), on CPU.
#   bash bench/experiments/beyond.sh                     (SEEDS, MUON_LR, CORPUS, OUT override the defaults)
set -euo pipefail
cd "$(dirname "$0")/../.."
SEEDS=${SEEDS:-"1337 1338 1339"}
MUON_LR=${MUON_LR:-0.2}
CORPUS=${CORPUS:-../shared/corpus}
OUT=${OUT:-runs/beyond}
PY=${VENV:-.venv}/bin/python
SPECS=(hetero hetero-qk all-dgram "attn=dgram-cap,mlp=dgram" auto)
mkdir -p "$OUT"
if [ ! -f "$OUT/data/prepare_progress.json" ]; then
    $PY -m data.split_text "$CORPUS"/*.txt --out "$OUT/books.jsonl"
    $PY -m data.prepare --files "$OUT/books.jsonl" --out-dir "$OUT/data" --val-fraction 0.1 --num-proc 1
fi
for seed in $SEEDS; do
    RUNS_DIR="$OUT/seed$seed" SKIP_SETUP=1 bash run.sh assign "${SPECS[@]}" --data-dir "$OUT/data" \
        --muon-lr "$MUON_LR" --seed "$seed" --device cpu "$@"
done
$PY -m tools.report "$OUT"/seed* --out "$OUT"
