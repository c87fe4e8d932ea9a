#!/usr/bin/env bash
# Entry points for common jobs.
#   bash run.sh quick [train flags...]     set up, get a small real dataset, run the five assignments on a
#                                          small GPT-2 (CPU or one GPU), write $RUNS_DIR/report.{md,png}
#   bash run.sh paper [train flags...]     the five assignments in the published setting, 8 GPUs (torchrun)
#   bash run.sh assign [--paper] SPEC... [train flags...]
#                                          any list of assignments (presets or key=manifold specs), quick
#                                          setting (or the paper's with --paper)
#   --jobs N (quick, paper, assign; or JOBS=N)
#                                          up to N runs at a time, each one's output in its folder's
#                                          train.log (N = 1: one after the other, output here). Default:
#                                          paper 1; quick on CPU min(runs, cores, available memory / 1.5 GB),
#                                          with OMP_NUM_THREADS = cores / N per run unless set; on a GPU 1
#   bash run.sh report FOLDER...           the table and figure of existing run folders (bench/report.py)
#   bash run.sh setup                      create .venv (if missing) and install requirements.txt
#   bash run.sh demo [train flags...]      a tiny hetero run on the bundled sample text (~30 s)
# Train flags go to every run and override the defaults (later flags win). Runs that diverge are
# recorded and the script goes on; a folder's finished runs are kept when it is run again (an
# interrupted one resumes); Ctrl-C stops every running run at its next step, checkpointed. Environment:
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
# What one quick run of train_gpt2.py takes in memory on CPU, for the default --jobs: its peak RSS
# (/usr/bin/time -v, bash run.sh assign hetero on the bundled sample) was 1.29 GB; with headroom.
QUICK_RUN_MB=1536
JOBS_N='' JOBS_WHY='' STOPPING=0

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

# Run every spec of SPECS with DEFAULTS + FLAGS in $RUNS_DIR, up to JOBS_N at a time, then write the report.
ablation() {
    local setting=$1 n=${#SPECS[@]} data_given=0 flag
    local -a data=()
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
        LAUNCH=("$VENV/bin/python" -m torch.distributed.run --standalone "--nproc_per_node=${NPROC:-8}")
        DEFAULTS=("${PAPER[@]}")
    else
        LAUNCH=("$VENV/bin/python")
        DEFAULTS=("${QUICK[@]}")
    fi
    DEFAULTS+=("${data[@]}")
    RUNS_DIR=${RUNS_DIR:-runs/$setting-$(date +%Y%m%d-%H%M%S)}
    mkdir -p "$RUNS_DIR"
    echo "== $n run(s) in $RUNS_DIR: ${SPECS[*]}"
    if [ -z "$JOBS_N" ]; then default_jobs "$setting" "$n"; fi
    if [ "$JOBS_N" -gt "$n" ]; then JOBS_N=$n; fi
    if [ "$JOBS_N" = 1 ]; then one_at_a_time; else side_by_side; fi
    report
}

# The run folder of spec $1
run_dir() { echo "$RUNS_DIR/$(echo "$1" | tr '=,' '-+')"; }

# Sets RESUME for the run in folder $1 (none, --resume auto or --overwrite); fails if the run is
# finished (completed or diverged: kept, and said so with $2 = "[i/n] spec").
prepare_run() {
    local status
    status=$(run_status "$1")
    case $status in
        completed|diverged) echo "== $2: already $status in $1, kept"; return 1 ;;
    esac
    RESUME=()
    if compgen -G "$1/ckpt_*.pt" > /dev/null; then RESUME=(--resume auto)
    elif [ -e "$1/config.json" ]; then RESUME=(--overwrite); fi
}

# Says how the run of spec $2 in folder $3 ended (exit status $4, its output $5) as "[$1] ..."; sets
# OUTCOME to on (go on to the next run), interrupted or unstarted (a mistake: stop with status 2).
finish_run() {
    local tag=$1 spec=$2 dir=$3 rc=$4 where=$5 status
    status=$(trap '' INT TERM; run_status "$dir")  # a Ctrl-C now reaches the runs, not this
    OUTCOME=on
    case $status in
        completed) echo "== [$tag] $spec: completed" ;;
        diverged) echo "== [$tag] $spec: diverged (recorded in $dir/summary.json), going on" ;;
        interrupted) echo "== [$tag] $spec: interrupted; rerun with RUNS_DIR=$RUNS_DIR to resume"
                     OUTCOME=interrupted ;;
        *) if [ "$STOPPING" = 1 ]; then  # stopped by Ctrl-C before it could checkpoint
               echo "== [$tag] $spec: stopped (status $rc); rerun with RUNS_DIR=$RUNS_DIR to run it"
               OUTCOME=interrupted
           elif [ "$rc" = 2 ] || [ ! -e "$dir/config.json" ]; then
               echo "== [$tag] $spec: did not start (status $rc, $where); stopping" >&2
               OUTCOME=unstarted
           else
               echo "== [$tag] $spec: failed with status $rc ($where), going on" >&2
           fi ;;
    esac
}

# --jobs 1: every run in the foreground, its output on the terminal.
one_at_a_time() {
    local i=0 spec dir rc
    for spec in "${SPECS[@]}"; do
        i=$((i + 1))
        dir=$(run_dir "$spec")
        prepare_run "$dir" "[$i/$n] $spec" || continue
        echo "== [$i/$n] $spec -> $dir ${RESUME[*]}"
        set +e
        "${LAUNCH[@]}" train_gpt2.py "${DEFAULTS[@]}" --run-name "$spec" "${FLAGS[@]}" \
            --assign "$spec" --out-dir "$dir" "${RESUME[@]}"
        rc=$?
        set -e
        finish_run "$i/$n" "$spec" "$dir" "$rc" above
        case $OUTCOME in
            interrupted) report; exit 4 ;;
            unstarted) exit 2 ;;
        esac
    done
}

# --jobs N > 1: up to N runs at a time in the background, each one's output in its folder's
# train.log. A Ctrl-C reaches every run (one process group): each checkpoints and stops.
side_by_side() {
    local next=0 running=0 stop=on i spec dir rc threads=${OMP_NUM_THREADS:-} live
    local -a pid=()
    local cores
    cores=$(count_cores)
    if [ -z "$threads" ]; then threads=$((cores / JOBS_N)); [ "$threads" -ge 1 ] || threads=1; fi
    echo "== up to $JOBS_N runs at a time$JOBS_WHY, OMP_NUM_THREADS=$threads each"
    echo "   each run's output goes to its folder's train.log (tail -f $RUNS_DIR/*/train.log to follow)"
    STOPPING=0
    # Ctrl-C: start no more runs, wait for the running ones to checkpoint. (Set before the runs
    # start: a background command then keeps the default SIGINT, which the trainer turns into a stop.)
    trap 'STOPPING=1' INT TERM
    while :; do
        while [ "$STOPPING" = 0 ] && [ "$stop" = on ] && [ "$running" -lt "$JOBS_N" ] && [ "$next" -lt "$n" ]; do
            spec=${SPECS[$next]}
            next=$((next + 1))
            dir=$(run_dir "$spec")
            prepare_run "$dir" "[$next/$n] $spec" || continue
            [ "$STOPPING" = 0 ] || { next=$((next - 1)); break; }  # a Ctrl-C just now: not started
            mkdir -p "$dir"
            echo "== [$next/$n] $spec -> $dir${RESUME[*]:+ ${RESUME[*]}} (output: $dir/train.log)"
            if [ ${#RESUME[@]} -gt 0 ] && [ "${RESUME[0]}" = --resume ]; then : >> "$dir/train.log"
            else : > "$dir/train.log"; fi
            ( export OMP_NUM_THREADS=$threads
              exec "${LAUNCH[@]}" train_gpt2.py "${DEFAULTS[@]}" --run-name "$spec" "${FLAGS[@]}" \
                  --assign "$spec" --out-dir "$dir" "${RESUME[@]}" >> "$dir/train.log" 2>&1 ) &
            pid[$next]=$!
            running=$((running + 1))
        done
        [ "$running" -gt 0 ] || break
        sleep 0.2 || true  # a Ctrl-C ends the sleep
        live=" $(jobs -rp | tr '\n' ' ') "
        for i in "${!pid[@]}"; do
            case $live in *" ${pid[$i]} "*) continue ;; esac
            rc=0
            wait "${pid[$i]}" || rc=$?
            unset "pid[$i]"
            running=$((running - 1))
            spec=${SPECS[$((i - 1))]}
            dir=$(run_dir "$spec")
            finish_run "$i/$n" "$spec" "$dir" "$rc" "see $dir/train.log"
            case $OUTCOME in
                interrupted) [ "$stop" = unstarted ] || stop=interrupted ;;
                unstarted) stop=unstarted
                           tail -n 3 "$dir/train.log" | sed 's/^/   /' >&2
                           [ "$running" = 0 ] || echo "== waiting for the $running running run(s) to finish (Ctrl-C stops them; a rerun resumes them)" >&2 ;;
            esac
        done
    done
    trap - INT TERM
    if [ "$stop" = unstarted ]; then exit 2; fi
    if [ "$stop" = interrupted ]; then report; exit 4; fi
    if [ "$STOPPING" = 1 ] && [ "$next" -lt "$n" ]; then
        echo "== stopped; rerun with RUNS_DIR=$RUNS_DIR to run the rest"
        report; exit 4
    fi
}

count_cores() { nproc 2>/dev/null || getconf _NPROCESSORS_ONLN 2>/dev/null || echo 1; }

# Sets JOBS_N (and JOBS_WHY) when neither --jobs nor JOBS is given: paper 1 (a run uses all the
# GPUs), quick on a GPU 1, quick on CPU as many as the cores and the available memory allow.
default_jobs() {
    local n=$2 cores mem_mb device=auto i
    JOBS_N=1
    [ "$1" = paper ] && return
    for ((i = 0; i < ${#FLAGS[@]}; i++)); do  # the last --device wins, as in the trainer
        case ${FLAGS[$i]} in
            --device) device=${FLAGS[$((i + 1))]:-auto} ;;
            --device=*) device=${FLAGS[$i]#--device=} ;;
        esac
    done
    cores=$(count_cores)
    mem_mb=$(awk '/^MemAvailable:/ { print int($2 / 1024) }' /proc/meminfo 2>/dev/null || true)
    [ "$cores" -gt 1 ] && [ "$n" -gt 1 ] && [ -n "$mem_mb" ] || return 0
    # on CPU: --device cpu, or auto without a GPU
    [ "$device" = cpu ] || { [ "$device" = auto ] && "$VENV/bin/python" -c \
        'import sys, torch; sys.exit(torch.cuda.is_available())' 2>/dev/null; } || return 0
    JOBS_N=$((mem_mb / QUICK_RUN_MB))
    [ "$JOBS_N" -le "$cores" ] || JOBS_N=$cores
    [ "$JOBS_N" -le "$n" ] || JOBS_N=$n
    [ "$JOBS_N" -ge 1 ] || JOBS_N=1
    JOBS_WHY=" (from $cores cores and $((mem_mb / 1024)) GB available at ${QUICK_RUN_MB} MB a run; --jobs N to choose)"
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

# Takes --jobs N / --jobs=N out of the arguments (into JOBS_N; JOBS=N in the environment is the
# same), leaving the rest in ARGS.
take_jobs() {
    local where=JOBS=
    JOBS_N=${JOBS:-}
    ARGS=()
    while [ $# -gt 0 ]; do
        case $1 in
            --jobs) [ $# -ge 2 ] || die "--jobs N: how many runs at a time, N missing"
                    JOBS_N=$2; where="--jobs "; shift 2 ;;
            --jobs=*) JOBS_N=${1#--jobs=}; where=--jobs=; shift ;;
            *) ARGS+=("$1"); shift ;;
        esac
    done
    [ -z "$JOBS_N" ] || [[ $JOBS_N =~ ^[1-9][0-9]*$ ]] ||
        die "$where$JOBS_N: --jobs N is how many runs at a time, a whole number from 1"
}

command=${1:-}
[ $# -gt 0 ] && shift
case "$command" in
    quick|paper|assign) take_jobs "$@"; set -- "${ARGS[@]}" ;;
esac
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
