#!/usr/bin/env bash
# Entry points for common jobs.
#   bash run.sh quick [train flags...]     set up, get a small real dataset, run the five assignments on a
#                                          small GPT-2 (CPU or one GPU), write $RUNS_DIR/report.{md,png}
#   bash run.sh paper [train flags...]     the five assignments in the published setting, 8 GPUs (torchrun)
#   bash run.sh assign [--paper] SPEC... [train flags...]
#                                          any list of assignments (presets or key=manifold specs), quick
#                                          setting (or the paper's with --paper)
#   bash run.sh report FOLDER...           the table and figure of existing run folders (bench/report.py)
#   bash run.sh setup                      create .venv (if missing) and install requirements.txt
#   bash run.sh demo [train flags...]      a tiny hetero run on the bundled sample text (~30 s)
# Train flags go to every run and override the defaults (later flags win). Runs that diverge are
# recorded and the script goes on; a folder's finished runs are kept when it is run again (an
# interrupted one resumes). Environment:
#   RUNS_DIR    where the run folders and the report go (default runs/quick-<time> or runs/paper-<time>)
#   VENV        the virtual environment (default .venv); SKIP_SETUP=1 uses it as it is
#   DATA_ROOT   where quick/paper put the data they prepare (default data)
#   NPROC       processes per node for paper (default 8)
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
DATA_ROOT=${DATA_ROOT:-data}
PRESETS=(unconstrained all-stiefel all-dgram hetero hetero-inv)
OWT_SAMPLE=stas/openwebtext-10k  # the first 10k OpenWebText documents; its parquet export has no script
# A small GPT-2 for a CPU or one GPU: a few minutes per assignment on one CPU core; higher
# learning rates than the paper's so that 200 steps learn something.
QUICK=(--n-layer 2 --n-head 4 --n-embd 128 --seq-len 128 --total-batch-size 8 --batch-size 8
       --max-steps 200 --warmup-steps 20 --lr 3e-3 --min-lr 3e-4 --muon-lr 0.05
       --eval-every 25 --eval-tokens 8192 --log-every 25)
# The published setting is the trainer's defaults: 64 x 1024 tokens per step on any number of GPUs
# (8 per GPU per micro-step; 8 GPUs: no accumulation, 1 GPU: 8 micro-steps).
PAPER=(--compile --wandb offline)

die() { echo "error: $*" >&2; exit 2; }

setup() {
    if [ "${SKIP_SETUP:-0}" = 1 ]; then
        [ -x "$VENV/bin/python" ] || die "SKIP_SETUP=1 but $VENV/bin/python does not exist"
        return
    fi
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
    "$VENV/bin/python" data/prepare.py --files data/sample/books.jsonl --out-dir data/sample_shards \
        --val-fraction 0.03
    "$VENV/bin/python" train_gpt2.py --assign hetero --data-dir data/sample_shards --out-dir runs/demo \
        --n-layer 2 --n-head 2 --n-embd 64 --seq-len 64 --total-batch-size 8 --batch-size 8 --max-steps 60 \
        --warmup-steps 1 --eval-every 30 --eval-tokens 4096 --device cpu --wandb off "$@"
}

# --- data --------------------------------------------------------------------------------

finished() { [ -f "$1/prepare_progress.json" ] && grep -q '"done": true' "$1/prepare_progress.json"; }

hub_reachable() {
    [ "${HF_HUB_OFFLINE:-0}" = 1 ] || [ "${HF_DATASETS_OFFLINE:-0}" = 1 ] && return 1
    "$VENV/bin/python" - <<'EOF' 2>/dev/null
import os, socket, urllib.parse
url = urllib.parse.urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
socket.create_connection((url.hostname, url.port or 443), timeout=5).close()
EOF
}

# Sets DATA_DIR for quick: a small OpenWebText sample from the hub, or offline the bundled text.
quick_data() {
    # the sample gets its own folder: prepare.py refuses one made from other input
    local owt="$DATA_ROOT/openwebtext-10k" sample="$DATA_ROOT/sample_books"
    if finished "$owt"; then DATA_DIR=$owt; return; fi
    if hub_reachable; then
        echo "== preparing $OWT_SAMPLE (10k OpenWebText documents, about 11M tokens) in $owt"
        if "$VENV/bin/python" data/prepare.py --dataset "$OWT_SAMPLE" --revision refs/convert/parquet \
                --out-dir "$owt" --val-fraction 0.01; then
            DATA_DIR=$owt; return
        fi
        echo "could not prepare $OWT_SAMPLE (above); using the bundled sample text instead" >&2
    fi
    echo "== no network: training on the bundled sample text (data/sample/books.jsonl: three public-domain"
    echo "   books, 214k tokens; under one epoch in the quick setting)."
    echo "   For your own text: $VENV/bin/python data/prepare.py --files books/*.txt more.jsonl --out-dir data/mine"
    echo "   then: bash run.sh quick --data-dir data/mine"
    "$VENV/bin/python" data/prepare.py --files data/sample/books.jsonl --out-dir "$sample" --val-fraction 0.03
    DATA_DIR=$sample
}

paper_data() {
    DATA_DIR="$DATA_ROOT/openwebtext"
    finished "$DATA_DIR" && return
    echo "== preparing OpenWebText in $DATA_DIR (about 75 GB of disk while it runs; see README)"
    "$VENV/bin/python" data/prepare.py --out-dir "$DATA_DIR"
}

# --- the ablation ------------------------------------------------------------------------

# Run every spec of SPECS with DEFAULTS + FLAGS in $RUNS_DIR, then write the report.
ablation() {
    local setting=$1 n=${#SPECS[@]} i=0 data_given=0 flag spec dir status rc
    local -a launch defaults resume data=()
    for flag in "${FLAGS[@]}"; do
        case $flag in
            --out-dir|--out-dir=*)
                die "run.sh gives every run its own --out-dir under RUNS_DIR; set RUNS_DIR instead" ;;
            --assign|--assign=*)
                die "run.sh sets --assign per run; use: bash run.sh assign SPEC... [train flags]" ;;
            --resume|--resume=*|--overwrite)
                die "run.sh decides --resume/--overwrite itself (finished runs are kept)" ;;
            --data-dir|--data-dir=*) data_given=1 ;;
        esac
    done
    setup
    if [ $data_given = 0 ]; then  # no --data-dir among the flags: prepare the setting's data
        if [ "$setting" = paper ]; then paper_data; else quick_data; fi
        data=(--data-dir "$DATA_DIR")
    fi
    if [ "$setting" = paper ]; then
        launch=("$VENV/bin/python" -m torch.distributed.run --standalone "--nproc_per_node=${NPROC:-8}")
        defaults=("${PAPER[@]}")
    else
        launch=("$VENV/bin/python")
        defaults=("${QUICK[@]}")
    fi
    RUNS_DIR=${RUNS_DIR:-runs/$setting-$(date +%Y%m%d-%H%M%S)}
    mkdir -p "$RUNS_DIR"
    echo "== $n run(s) in $RUNS_DIR: ${SPECS[*]}"
    for spec in "${SPECS[@]}"; do
        i=$((i + 1))
        dir="$RUNS_DIR/$(echo "$spec" | tr '=,' '-+')"
        status=$(run_status "$dir")
        case $status in
            completed|diverged) echo "== [$i/$n] $spec: already $status in $dir, kept"; continue ;;
        esac
        resume=()
        if compgen -G "$dir/ckpt_*.pt" > /dev/null; then resume=(--resume auto)
        elif [ -e "$dir/config.json" ]; then resume=(--overwrite); fi
        echo "== [$i/$n] $spec -> $dir ${resume[*]}"
        set +e
        "${launch[@]}" train_gpt2.py "${defaults[@]}" "${data[@]}" --run-name "$spec" "${FLAGS[@]}" \
            --assign "$spec" --out-dir "$dir" "${resume[@]}"
        rc=$?
        set -e
        status=$(run_status "$dir")
        case $status in
            completed) echo "== [$i/$n] $spec: completed" ;;
            diverged) echo "== [$i/$n] $spec: diverged (recorded in $dir/summary.json), going on" ;;
            interrupted) echo "== [$i/$n] $spec: interrupted; rerun with RUNS_DIR=$RUNS_DIR to resume"
                         report; exit 4 ;;
            *) if [ "$rc" = 2 ] || [ ! -e "$dir/config.json" ]; then
                   echo "== [$i/$n] $spec: did not start (status $rc, above); stopping" >&2; exit 2
               fi
               echo "== [$i/$n] $spec: failed with status $rc (above), going on" >&2 ;;
        esac
    done
    report
}

# completed | diverged | interrupted | none: what summary.json says of a run folder
run_status() {
    "$VENV/bin/python" -c 'import json, sys
try:
    print(json.load(open(sys.argv[1] + "/summary.json"))["status"])
except (OSError, ValueError, KeyError):
    print("none")' "$1"
}

report() {
    echo "== report"
    "$VENV/bin/python" bench/report.py "$RUNS_DIR"
}

command=${1:-}
[ $# -gt 0 ] && shift
case "$command" in
    setup) setup ;;
    demo) demo "$@" ;;
    quick) SPECS=("${PRESETS[@]}"); FLAGS=("$@"); ablation quick ;;
    paper) SPECS=("${PRESETS[@]}"); FLAGS=("$@"); ablation paper ;;
    assign)
        setting=quick
        if [ "${1:-}" = --paper ]; then setting=paper; shift; fi
        SPECS=()
        while [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; do SPECS+=("$1"); shift; done
        [ ${#SPECS[@]} -gt 0 ] || die "bash run.sh assign [--paper] SPEC... [train flags...]: no SPEC given"
        FLAGS=("$@"); ablation "$setting" ;;
    report) [ $# -gt 0 ] || die "bash run.sh report FOLDER..."
            setup; "$VENV/bin/python" bench/report.py "$@" ;;
    *) echo "usage: bash run.sh {quick|paper|assign|report|setup|demo} [...] (see the top of run.sh)" >&2; exit 2 ;;
esac
