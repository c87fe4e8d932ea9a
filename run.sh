#!/usr/bin/env bash
# Entry points for common jobs.
#   bash run.sh quick [train flags...]     set up, get a small real dataset, run the five assignments on a
#                                          small GPT-2 (CPU or one GPU), write $RUNS_DIR/report.{md,png}
#   bash run.sh paper [train flags...]     the five assignments in the published setting, 8 GPUs (torchrun)
#   bash run.sh assign [--paper] SPEC... [train flags...]
#                                          any list of assignments (presets or key=manifold specs), quick
#                                          setting (or the paper's with --paper)
#   --seeds "S1 S2 ..." (quick, paper, assign)
#                                          each assignment once per seed, in $RUNS_DIR/<spec>/seed<S>
#   bash run.sh sweep [--paper] [--muon-lrs "A B ..."] [--seeds "S1 S2 ..."] [SPEC...] [train flags...]
#                                          each assignment (default the five presets) at each Muon lr
#                                          (default 0.02 0.05 0.1) and seed (default 1 2 3), quick setting,
#                                          in $RUNS_DIR/<spec>/lr<A>/seed<S>; then $RUNS_DIR/sweep.{md,png}:
#                                          mean ± sd per cell, each at its best lr, Welch and paired t-tests
#                                          (tools/sweep_report.py). The sweep sets --muon-lr and --seed
#                                          per run (--seeds sets --seed): the train flags must not
#   --jobs N (quick, paper, assign, sweep; or JOBS=N)
#                                          up to N runs at a time, each one's output in its folder's
#                                          train.log (N = 1: one after the other, output here). Default:
#                                          paper 1; quick on CPU min(runs, cores, available memory / 1.5 GB),
#                                          with OMP_NUM_THREADS = cores / N per run unless set (a run
#                                          that starts when fewer are left gets the cores they free);
#                                          on a GPU 1
#   bash run.sh report FOLDER...           the table and figure of existing run folders (tools/report.py)
#   bash run.sh setup                      create .venv (if missing) and install requirements.txt
#   bash run.sh demo [train flags...]      a tiny hetero run on the bundled sample text (~30 s)
# Train flags go to every run and override the defaults (later flags win). Runs that diverge are
# recorded and the script goes on; a folder's finished runs are kept when it is run again (an
# interrupted one resumes); Ctrl-C stops every running run at its next step, checkpointed. Environment:
#   RUNS_DIR    where the run folders and the report go (default runs/<quick|paper|sweep>-<time>)
#   VENV        the virtual environment (default .venv); SKIP_SETUP=1 uses it as it is
#   DATA_ROOT   where quick/paper put the data they prepare (default data)
#   NPROC       processes per node for paper (default 8)
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
DATA_ROOT=${DATA_ROOT:-data}
PRESETS=(unconstrained all-stiefel all-dgram hetero hetero-inv)
SWEEP_LRS=(0.02 0.05 0.1) SWEEP_SEEDS=(1 2 3)  # sweep's default grid: around quick's --muon-lr 0.05
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
    "$VENV/bin/python" -m data.prepare --files data/sample/books.jsonl --out-dir data/sample_shards \
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
        if "$VENV/bin/python" -m data.prepare --dataset "$OWT_SAMPLE" --revision refs/convert/parquet \
                --out-dir "$owt" --val-fraction 0.01; then
            DATA_DIR=$owt; return
        fi
        echo "could not prepare $OWT_SAMPLE (above); using the bundled sample text instead" >&2
    fi
    echo "== no network: training on the bundled sample text (data/sample/books.jsonl: three public-domain"
    echo "   books, 214k tokens; under one epoch in the quick setting)."
    echo "   For your own text: $VENV/bin/python -m data.prepare --files books/*.txt more.jsonl --out-dir data/mine"
    echo "   then: bash run.sh quick --data-dir data/mine"
    "$VENV/bin/python" -m data.prepare --files data/sample/books.jsonl --out-dir "$sample" --val-fraction 0.03
    DATA_DIR=$sample
}

paper_data() {
    DATA_DIR="$DATA_ROOT/openwebtext"
    finished "$DATA_DIR" && return
    echo "== preparing OpenWebText in $DATA_DIR (about 75 GB of disk while it runs; see docs/data.md)"
    "$VENV/bin/python" -m data.prepare --out-dir "$DATA_DIR"
}

# --- the ablation ------------------------------------------------------------------------

# Run every planned run (plan_runs: each spec of SPECS, over LRS and SEEDS when given) with
# DEFAULTS + FLAGS + its own flags in $RUNS_DIR, up to JOBS_N at a time, then write the report.
ablation() {
    local setting=$1 n data_given=0 flag
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
    grid_flags_clash
    setup
    if [ "$setting" = paper ]; then
        LAUNCH=("$VENV/bin/python" -m torch.distributed.run --standalone "--nproc_per_node=${NPROC:-8}")
        DEFAULTS=("${PAPER[@]}")
    else
        LAUNCH=("$VENV/bin/python")
        DEFAULTS=("${QUICK[@]}")
    fi
    local name=$setting
    if [ "$command" = sweep ]; then name=sweep; [ "$setting" = quick ] || name=sweep-paper; fi
    RUNS_DIR=${RUNS_DIR:-runs/$name-$(date +%Y%m%d-%H%M%S)}
    plan_runs
    if [ "$setting" = paper ]; then check_train_flags "${NPROC:-8}" $data_given
    else check_train_flags 1 $data_given; fi
    if [ $data_given = 0 ]; then  # no --data-dir among the flags: prepare the setting's data
        if [ "$setting" = paper ]; then paper_data; else quick_data; fi
        data=(--data-dir "$DATA_DIR")
    fi
    DEFAULTS+=("${data[@]}")
    mkdir -p "$RUNS_DIR"
    n=${#PLAN_SPEC[@]}
    echo "== $n run(s) in $RUNS_DIR: ${SPECS[*]}${LRS[*]:+; Muon lr ${LRS[*]}}${SEEDS[*]:+; seeds ${SEEDS[*]}}"
    if [ -z "$JOBS_N" ]; then default_jobs "$setting" "$n"; fi
    if [ "$JOBS_N" -gt "$n" ]; then JOBS_N=$n; fi
    if [ "$JOBS_N" = 1 ]; then one_at_a_time; else side_by_side; fi
    report
}

# The folder of spec $1 (made folder-safe)
run_dir() { echo "$RUNS_DIR/$(echo "$1" | tr '=,' '-+')"; }

# The planned runs, one per spec of SPECS, or with LRS and/or SEEDS one per (seed, lr, spec),
# seed-major (a sweep stopped early has every spec and lr at its first seeds). Run i has the folder
# PLAN_DIR[i] ($RUNS_DIR/<spec>[/lr<lr>][/seed<seed>]), its own train flags PLAN_FLAGS[i] (after
# the user's; numbers only, validated, so a plain string), its --run-name PLAN_NAME[i] and its name in
# the progress lines PLAN_TAG[i].
plan_runs() {
    local spec lr seed dir flags name what
    local -a lrs=("${LRS[@]}") seeds=("${SEEDS[@]}")
    [ ${#lrs[@]} -gt 0 ] || lrs=('')
    [ ${#seeds[@]} -gt 0 ] || seeds=('')
    PLAN_SPEC=() PLAN_DIR=() PLAN_FLAGS=() PLAN_NAME=() PLAN_TAG=()
    LOG_GLOB="$RUNS_DIR/*${LRS[*]:+/lr*}${SEEDS[*]:+/seed*}/train.log"
    for seed in "${seeds[@]}"; do
        for lr in "${lrs[@]}"; do
            for spec in "${SPECS[@]}"; do
                dir=$(run_dir "$spec") flags='' name=$spec what=''
                if [ -n "$lr" ]; then dir+=/lr$lr; flags+=" --muon-lr $lr"; name+=/lr$lr; what+=", lr $lr"; fi
                if [ -n "$seed" ]; then dir+=/seed$seed; flags+=" --seed $seed"; name+=/seed$seed; what+=", seed $seed"; fi
                PLAN_SPEC+=("$spec") PLAN_DIR+=("$dir") PLAN_FLAGS+=("$flags") PLAN_NAME+=("$name")
                PLAN_TAG+=("$spec${what:+ (${what#, })}")
            done
        done
    done
}

# Checks the train flags of every planned run once, before any data is prepared, any folder made
# or any run started: the trainer's own parse_args and validate_args at world size $1, and with
# $2 = 1 (--data-dir given) the shards of --data-dir. A mistake stops run.sh with one `error:`
# line (status 2); --help among the flags shows the trainer's help and stops (status 0).
check_train_flags() {
    local i rc=0
    local -a plan=()
    for ((i = 0; i < ${#PLAN_SPEC[@]}; i++)); do plan+=("${PLAN_SPEC[$i]}" "${PLAN_FLAGS[$i]}"); done
    "$VENV/bin/python" - "$1" "$2" "${plan[@]}" -- "${DEFAULTS[@]}" "${FLAGS[@]}" <<'EOF' || rc=$?
import contextlib, io, sys
from errors import UserError, run_cli
import train_gpt2
sys.argv[0] = "train_gpt2.py"  # argparse's name for the trainer in --help

def parse(argv):
    said = io.StringIO()  # argparse's usage and message: only the message is shown
    try:
        with contextlib.redirect_stderr(said), contextlib.redirect_stdout(said):
            return train_gpt2.parse_args(argv)
    except SystemExit as stop:
        if stop.code == 0:  # --help
            print(said.getvalue(), end="")
            sys.exit(3)
        raise UserError(said.getvalue().strip().splitlines()[-1].split("error: ", 1)[-1]) from None

def check(_):
    world_size, check_data = int(sys.argv[1]), sys.argv[2] == "1"
    end = sys.argv.index("--")
    plan, common = sys.argv[3:end], sys.argv[end + 1:]
    for spec, own in zip(plan[::2], plan[1::2]):  # each run: its --assign and its grid flags
        args = parse([*common, *own.split(), "--assign", spec])
        train_gpt2.validate_args(args, world_size)
    if check_data:
        for split in ("train", "val"):
            train_gpt2.TokenStream(train_gpt2.find_shards(args.data_dir, split), args.vocab_size)

run_cli(check)
EOF
    case $rc in
        0) ;;
        3) exit 0 ;;
        *) exit 2 ;;
    esac
}

# Sets CMD: the trainer's command line for planned run $1 (uses RESUME).
train_command() {
    local -a own
    read -r -a own <<< "${PLAN_FLAGS[$1]}"
    CMD=("${LAUNCH[@]}" train_gpt2.py "${DEFAULTS[@]}" --run-name "${PLAN_NAME[$1]}" "${FLAGS[@]}" "${own[@]}"
         --assign "${PLAN_SPEC[$1]}" --out-dir "${PLAN_DIR[$1]}" "${RESUME[@]}")
}

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

# Says how the run named $2 (its PLAN_TAG) in folder $3 ended (exit status $4, its output $5) as "[$1] ..."; sets
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
    local i tag dir rc
    for ((i = 0; i < n; i++)); do
        tag="[$((i + 1))/$n] ${PLAN_TAG[$i]}" dir=${PLAN_DIR[$i]}
        prepare_run "$dir" "$tag" || continue
        echo "== $tag -> $dir ${RESUME[*]}"
        train_command "$i"
        set +e
        "${CMD[@]}"
        rc=$?
        set -e
        finish_run "$((i + 1))/$n" "${PLAN_TAG[$i]}" "$dir" "$rc" above
        case $OUTCOME in
            interrupted) report; exit 4 ;;
            unstarted) exit 2 ;;
        esac
    done
}

# --jobs N > 1: up to N runs at a time in the background, each one's output in its folder's
# train.log. A Ctrl-C reaches every run (one process group): each checkpoints and stops.
# Unless OMP_NUM_THREADS is set, a run starts with the cores the running ones leave free, shared
# with the runs that can start beside it: cores / N while N or more runs are left, all the cores
# for a last run that starts alone.
side_by_side() {
    local next=0 running=0 stop=on i tag dir rc threads=${OMP_NUM_THREADS:-} live cores busy=0 left
    local -a pid=() held=() live_pids=()
    cores=$(count_cores)
    if [ -n "$threads" ]; then echo "== up to $JOBS_N runs at a time$JOBS_WHY, OMP_NUM_THREADS=$threads each"
    else echo "== up to $JOBS_N runs at a time$JOBS_WHY, OMP_NUM_THREADS = the $cores cores shared among them"; fi
    echo "   each run's output goes to its folder's train.log (tail -f $LOG_GLOB to follow)"
    STOPPING=0
    # which runs are live is read through a file: a pipe or $(...) forks a process that a Ctrl-C
    # kills (status 130, which set -e would make this script's), a builtin's redirection does not
    LIVE_FILE=$(mktemp)
    trap 'rm -f "$LIVE_FILE"' EXIT  # also when set -e ends the script inside the loop
    # Ctrl-C: start no more runs, wait for the running ones to checkpoint. (Set before the runs
    # start: a background command then keeps the default SIGINT, which the trainer turns into a stop.)
    trap 'STOPPING=1' INT TERM
    while :; do
        while [ "$STOPPING" = 0 ] && [ "$stop" = on ] && [ "$running" -lt "$JOBS_N" ] && [ "$next" -lt "$n" ]; do
            dir=${PLAN_DIR[$next]} tag="[$((next + 1))/$n] ${PLAN_TAG[$next]}"
            next=$((next + 1))
            prepare_run "$dir" "$tag" || continue
            [ "$STOPPING" = 0 ] || { next=$((next - 1)); break; }  # a Ctrl-C just now: not started
            mkdir -p "$dir"
            if [ -z "${OMP_NUM_THREADS:-}" ]; then  # the free cores over the runs that may start now
                left=$((n - next + 1))                 # (this one and the later ones)
                [ "$left" -le $((JOBS_N - running)) ] || left=$((JOBS_N - running))
                threads=$(((cores - busy) / left))
                [ "$threads" -ge 1 ] || threads=1
            fi
            echo "== $tag -> $dir${RESUME[*]:+ ${RESUME[*]}} (output: $dir/train.log, OMP_NUM_THREADS=$threads)"
            if [ ${#RESUME[@]} -gt 0 ] && [ "${RESUME[0]}" = --resume ]; then : >> "$dir/train.log"
            else : > "$dir/train.log"; fi
            train_command "$((next - 1))"
            ( export OMP_NUM_THREADS=$threads
              exec "${CMD[@]}" >> "$dir/train.log" 2>&1 ) &
            pid[$next]=$! held[$next]=$threads
            running=$((running + 1)) busy=$((busy + threads))
        done
        [ "$running" -gt 0 ] || break
        sleep 0.2 || true  # a Ctrl-C ends the sleep
        jobs -rp > "$LIVE_FILE"
        mapfile -t live_pids < "$LIVE_FILE"
        live=" ${live_pids[*]} "
        for i in "${!pid[@]}"; do
            case $live in *" ${pid[$i]} "*) continue ;; esac
            rc=0
            wait "${pid[$i]}" || rc=$?
            running=$((running - 1)) busy=$((busy - held[$i]))
            unset "pid[$i]" "held[$i]"
            dir=${PLAN_DIR[$((i - 1))]}
            finish_run "$i/$n" "${PLAN_TAG[$((i - 1))]}" "$dir" "$rc" "see $dir/train.log"
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

# The report of $RUNS_DIR: a sweep's statistics (tools/sweep_report.py), else the table of runs.
report() {
    echo "== report"
    if [ "$command" = sweep ]; then "$VENV/bin/python" -m tools.sweep_report "$RUNS_DIR"
    else "$VENV/bin/python" -m tools.report "$RUNS_DIR"; fi
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

# Takes --muon-lrs "A B ..." and --seeds "S1 S2 ..." (or --muon-lrs=..., --seeds=...) out of the
# arguments into LRS and SEEDS, checked (a mistake would otherwise surface as a run that does not
# start), leaving the rest in ARGS. Seeds are written without leading zeros: one folder per seed.
take_grid() {
    local name value item
    local -a items
    ARGS=()
    while [ $# -gt 0 ]; do
        case $1 in
            --muon-lrs|--seeds) [ $# -ge 2 ] || die "$1 \"A B ...\": the list is missing"
                                name=$1 value=$2; shift 2 ;;
            --muon-lrs=*|--seeds=*) name=${1%%=*} value=${1#*=}; shift ;;
            *) ARGS+=("$1"); shift; continue ;;
        esac
        read -r -d '' -a items <<< "$value" || true  # -d '': newlines separate too
        [ ${#items[@]} -gt 0 ] || die "$name \"$value\": an empty list"
        if [ "$name" = --muon-lrs ]; then
            LRS=()
            for item in "${items[@]}"; do
                positive_number "$item" || die "$name: $item is not a positive number (e.g. 0.05 or 5e-2)"
                LRS+=("$item")
            done
        else
            SEEDS=()
            for item in "${items[@]}"; do
                [[ $item =~ ^[0-9]{1,18}$ ]] || die "$name: $item is not a seed (a whole number from 0, up to 18 digits)"
                SEEDS+=("$((10#$item))")
            done
        fi
        twice "$name"
    done
}

positive_number() {
    [[ $1 =~ ^([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?$ ]] && awk -v x="$1" 'BEGIN { exit !(x + 0 > 0) }'
}

# Fails if a value (LRS or SEEDS, the list $1 names) is given twice: both runs would share a folder.
twice() {
    local name=$1 seen=' ' item
    local -a list
    if [ "$name" = --muon-lrs ]; then list=("${LRS[@]}"); else list=("${SEEDS[@]}"); fi
    for item in "${list[@]}"; do
        case $seen in *" $item "*) die "$name: $item given twice" ;; esac
        seen+="$item "
    done
}

# Fails if the train flags set what the grid sets per run (--muon-lr for LRS, --seed for SEEDS),
# abbreviations included (the trainer's argparse takes --muon or --see).
grid_flags_clash() {
    local flag name
    for flag in "${FLAGS[@]}"; do
        name=${flag%%=*}
        if [ ${#LRS[@]} -gt 0 ] && [ ${#name} -ge 4 ] && [[ --muon-lr == "$name"* ]]; then
            die "$flag: the sweep sets --muon-lr per run; give the learning rates as --muon-lrs \"A B ...\""
        fi
        if [ ${#SEEDS[@]} -gt 0 ] && [ ${#name} -ge 5 ] && [[ --seed == "$name"* ]]; then
            die "$flag: --seeds sets --seed per run; leave --seed out of the train flags"
        fi
    done
}

command=${1:-}
[ $# -gt 0 ] && shift
LRS=() SEEDS=()
case "$command" in
    quick|paper|assign|sweep) take_jobs "$@"; set -- "${ARGS[@]}"; take_grid "$@"; set -- "${ARGS[@]}" ;;
esac
case "$command" in
    quick|paper|assign) [ ${#LRS[@]} = 0 ] ||
        die "--muon-lrs is a grid: bash run.sh sweep --muon-lrs \"${LRS[*]}\" [SPEC...] [train flags...]" ;;
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
    sweep)
        setting=quick
        if [ "${1:-}" = --paper ]; then setting=paper; shift; fi
        SPECS=()
        while [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; do SPECS+=("$1"); shift; done
        [ ${#SPECS[@]} -gt 0 ] || SPECS=("${PRESETS[@]}")
        [ ${#LRS[@]} -gt 0 ] || LRS=("${SWEEP_LRS[@]}")
        [ ${#SEEDS[@]} -gt 0 ] || SEEDS=("${SWEEP_SEEDS[@]}")
        FLAGS=("$@"); ablation "$setting" ;;
    report) [ $# -gt 0 ] || die "bash run.sh report FOLDER..."
            setup; "$VENV/bin/python" -m tools.report "$@" ;;
    *) echo "usage: bash run.sh {quick|paper|assign|sweep|report|setup|demo} [...] (see the top of run.sh)" >&2; exit 2 ;;
esac
