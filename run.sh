#!/usr/bin/env bash
# Entry points for common jobs.
#   bash run.sh setup          create .venv (if missing) and install requirements.txt
#   bash run.sh demo [flags]   setup, tokenize the bundled sample text, train a tiny hetero model on CPU
#                              (extra flags go to train_gpt2.py and override the demo's)
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}

setup() {
    if [ ! -x "$VENV/bin/python" ]; then
        echo "creating $VENV"
        "$PYTHON" -m venv "$VENV"
    fi
    echo "installing requirements.txt into $VENV"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check -r requirements.txt
}

demo() {
    setup
    rm -rf data/sample_shards  # tokenize afresh: prepare.py refuses a folder made from other input
    "$VENV/bin/python" data/prepare.py --files data/sample/alice.jsonl --out-dir data/sample_shards \
        --val-fraction 0.1
    "$VENV/bin/python" train_gpt2.py --assign hetero --data-dir data/sample_shards --out-dir runs/demo \
        --n-layer 2 --n-head 2 --n-embd 64 --seq-len 64 --batch-size 8 --max-steps 60 \
        --warmup-steps 1 --eval-every 30 --eval-tokens 4096 --device cpu --wandb off "$@"
}

command=${1:-}
[ $# -gt 0 ] && shift
case "$command" in
    setup) setup ;;
    demo) demo "$@" ;;
    *) echo "usage: bash run.sh {setup|demo} [train flags...]" >&2; exit 2 ;;
esac
