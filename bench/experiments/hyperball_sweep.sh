#!/usr/bin/env bash
# Issue 51's quick-setting comparison (docs/experiments.md section 7): the Hyperball presets at
# Muon lr 0.02 and 0.05, the baselines at their best lr of section 5 (hetero and all-stiefel 0.05,
# unconstrained 0.02), 3 seeds, on the books that bench/experiments/scheme_compare.sh prepares; resumable
# (run.sh keeps finished runs). Then: python -m tools.sweep_report runs/hyperball-quick --out docs/experiments/hyperball-quick
set -euo pipefail
cd "$(dirname "$0")/../.."
export RUNS_DIR=${RUNS_DIR:-runs/hyperball-quick} SKIP_SETUP=${SKIP_SETUP:-1}
DATA=${DATA:-runs/scheme-compare/data}
TRAIN=(--data-dir "$DATA" --device cpu)
bash run.sh sweep --muon-lrs 0.05 --seeds "1 2 3" --jobs 2 hetero-hyperball all-hyperball hetero all-stiefel "${TRAIN[@]}"
bash run.sh sweep --muon-lrs 0.02 --seeds "1 2 3" --jobs 2 hetero-hyperball all-hyperball unconstrained "${TRAIN[@]}"
