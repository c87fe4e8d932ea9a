"""run.sh end to end on tiny settings: the ablation commands, their outputs and their mistakes."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from synthetic import make_shards

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRESETS = ["unconstrained", "all-stiefel", "all-dgram", "hetero", "hetero-inv"]
TINY = ["--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--seq-len", "32", "--batch-size", "4",
        "--total-batch-size", "8",
        "--max-steps", "4", "--warmup-steps", "1", "--eval-every", "2", "--eval-tokens", "256", "--device", "cpu"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return make_shards(str(tmp_path_factory.mktemp("data")))


def run_sh(tmp_path, *args, **env):
    """bash run.sh ARGS with this interpreter's environment as VENV (no pip install)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SKIP_SETUP": "1", "VENV": sys.prefix,
           "RUNS_DIR": str(tmp_path / "runs"), **env}
    return subprocess.run(["bash", os.path.join(ROOT, "run.sh"), *args], capture_output=True, text=True,
                          timeout=300, env=env)


def report_rows(runs_dir):
    text = open(os.path.join(runs_dir, "report.md")).read()
    return {line.split("|")[1].strip(" `"): [c.strip() for c in line.strip().strip("|").split("|")]
            for line in text.splitlines() if line.startswith("| `")}


@pytest.fixture(scope="module")
def quick_one_at_a_time(data_dir, tmp_path_factory):
    """run.sh quick --jobs 1 on TINY: (its RUNS_DIR, its result)."""
    tmp = tmp_path_factory.mktemp("quick")
    return tmp / "runs", run_sh(tmp, "quick", "--jobs", "1", "--data-dir", data_dir, "--vocab-size", "64", *TINY)


def test_quick_runs_the_five_presets_and_writes_the_report(quick_one_at_a_time):
    runs, result = quick_one_at_a_time
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for i, preset in enumerate(PRESETS, 1):
        assert f"== [{i}/5] {preset}: completed" in result.stdout  # progress
        summary = json.load(open(runs / preset / "summary.json"))
        config = json.load(open(runs / preset / "config.json"))
        assert summary["status"] == "completed" and summary["steps"] == 4
        assert config["assign"] == preset and config["n_embd"] == 32  # the extra flags won over the defaults
        assert config["eval_every"] == 2 and config["run_name"] == preset
    rows = report_rows(runs)
    assert list(rows) == PRESETS
    for preset, row in rows.items():
        summary = json.load(open(runs / preset / "summary.json"))
        # tokens: 4 steps x 8 sequences x 32
        assert row[1] == f"{summary['final_val_loss']:.4f}" and row[2] == "4" and row[3] == "1,024"
    assert rows["all-stiefel"][7] == rows["all-stiefel"][8] == "1.000"  # Stiefel: every sigma is 1
    assert (runs / "report.png").stat().st_size > 20_000


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_assign_records_divergence_goes_on_and_keeps_finished_runs(jobs, data_dir, tmp_path):
    wild = ["--lr", "30", "--muon-lr", "2", "--warmup-steps", "0", "--max-steps", "30"]
    result = run_sh(tmp_path, "assign", "hetero", "attn=dgram,mlp=none", "--data-dir", data_dir,
                    "--vocab-size", "64", *TINY, *wild, "--jobs", jobs)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "== [1/2] hetero: diverged" in result.stdout and "== [2/2] attn=dgram,mlp=none: diverged" in result.stdout
    runs = tmp_path / "runs"
    rows = report_rows(runs)
    for spec, folder in [("hetero", "hetero"), ("attn=dgram,mlp=none", "attn-dgram+mlp-none")]:
        step = json.load(open(runs / folder / "summary.json"))["diverged"]["step"]
        assert rows[spec][1] == f"diverged at step {step}"
    again = run_sh(tmp_path, "assign", "hetero", "--data-dir", data_dir, "--vocab-size", "64", *TINY, *wild)
    assert again.returncode == 0 and "hetero: already diverged" in again.stdout


def test_quick_without_data_dir_offline_trains_on_the_bundled_sample(tmp_path):
    result = run_sh(tmp_path, "assign", "hetero", *TINY, DATA_ROOT=str(tmp_path / "data"), HF_HUB_OFFLINE="1")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "no network" in result.stdout and "-m data.prepare --files" in result.stdout
    config = json.load(open(tmp_path / "runs" / "hetero" / "config.json"))
    assert config["data_dir"] == str(tmp_path / "data" / "sample_books") and config["vocab_size"] == 50304


@pytest.mark.parametrize("args, message", [
    (["quick", "--out-dir", "x"], "set RUNS_DIR instead"),
    (["quick", "--assign", "hetero"], "bash run.sh assign"),
    (["assign", "--max-steps", "3"], "no SPEC given"),
    (["nonsense"], "usage: bash run.sh"),
    (["quick", "--jobs", "0"], "--jobs 0: --jobs N is how many runs at a time"),
    (["assign", "hetero", "--jobs", "x"], "--jobs x: --jobs N is how many runs at a time"),
    (["quick", "--jobs"], "N missing"),
])
def test_mistakes_are_one_clean_line(args, message, tmp_path):
    result = run_sh(tmp_path, *args)
    assert result.returncode == 2 and message in result.stderr and not (tmp_path / "runs").exists()


@pytest.mark.parametrize("sharding", [[], ["--fsdp"]], ids=["ddp", "fsdp"])
def test_assign_paper_runs_under_torchrun(data_dir, tmp_path, sharding):
    # the paper setting's launcher, on 2 CPU processes; its --compile and wandb undone by flags;
    # --fsdp passed through to the trainer
    result = run_sh(tmp_path, "assign", "--paper", "hetero", "--data-dir", data_dir, "--vocab-size", "64", *TINY,
                    "--no-compile", "--wandb", "off", *sharding, NPROC="2")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    config = json.load(open(tmp_path / "runs" / "hetero" / "config.json"))
    assert config["world_size"] == 2 and config["batch_size"] == 4 and config["compile"] is False
    assert config["fsdp"] is bool(sharding)
    assert config["n_layer"] == 1 and config["wandb"] == "off"
    assert report_rows(tmp_path / "runs")["hetero"][2] == "4"


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_ctrl_c_stops_the_ablation_and_a_rerun_resumes(jobs, data_dir, tmp_path):
    # --jobs 2: hetero and unconstrained run side by side and both stop; all-dgram never starts
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SKIP_SETUP": "1", "VENV": sys.prefix,
           "RUNS_DIR": str(tmp_path / "runs")}
    specs = ["hetero", "unconstrained"] + (["all-dgram"] if jobs == "2" else [])
    args = ["assign", *specs, "--data-dir", data_dir, "--vocab-size", "64", *TINY,
            "--max-steps", "60", "--ckpt-every", "5", "--jobs", jobs]
    proc = subprocess.Popen(["bash", os.path.join(ROOT, "run.sh"), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    first = tmp_path / "runs" / "hetero" / "ckpt_00000010.pt"
    deadline = time.time() + 120
    while not first.exists():
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the whole foreground group
    # which runs had started, and finished, when Ctrl-C came, read right after it: unconstrained can
    # finish and the next run start before hetero's checkpoint (seen on a fresh venv and on an idle
    # CI machine), and a snapshot taken before the signal races with that start
    started = {name for name in specs if (tmp_path / "runs" / name).exists()}
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 4, out[-2000:] + err[-2000:]
    assert "hetero: interrupted" in out
    # nothing starts after Ctrl-C: all-dgram (--jobs 2) or unconstrained (--jobs 1) never ran unless it had begun
    assert {name for name in specs if (tmp_path / "runs" / name).exists()} == started
    summary = tmp_path / "runs" / "unconstrained" / "summary.json"
    completed = summary.exists() and json.load(open(summary))["status"] == "completed"
    # and the last run had begun only in a slot a finished run freed: at --jobs 1 hetero was still
    # running (unconstrained waits for it), at --jobs 2 all-dgram waits for unconstrained to complete
    assert specs[-1] not in started or (jobs == "2" and completed), (started, out)
    if jobs == "2" and not completed:  # side by side: both stop (unless it was at its last step)
        # at a step it checkpoints and says so; still starting up (no handler yet) it dies of the signal
        if "unconstrained: interrupted" in out:
            assert "stopped by SIGINT" in open(tmp_path / "runs" / "unconstrained" / "train.log").read()
        else:
            assert "unconstrained: stopped (status 130)" in out, out
    again = run_sh(tmp_path, *args)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert "hetero -> " in again.stdout and "--resume auto" in again.stdout
    for name in specs:
        summary = json.load(open(tmp_path / "runs" / name / "summary.json"))
        assert summary["status"] == "completed" and summary["steps"] == 60


def test_side_by_side_gives_the_same_results_as_one_at_a_time(quick_one_at_a_time, data_dir, tmp_path):
    # each run is its own process with its own seed and data: with one thread each, bitwise the same.
    # Three of quick's presets (assign runs quick's setting) at --jobs 2, the third in the slot the
    # first to finish frees, against quick --jobs 1's
    runs, presets = tmp_path / "runs", ["unconstrained", "all-dgram", "hetero"]
    result = run_sh(tmp_path, "assign", *presets, "--jobs", "2", "--data-dir", data_dir, "--vocab-size", "64", *TINY)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    one_runs, one_result = quick_one_at_a_time
    # --jobs 1: the trainer's output on the terminal as before; --jobs 2: in each run's folder
    assert "done: {" in one_result.stdout and "done: {" not in result.stdout
    assert "up to 2 runs at a time, OMP_NUM_THREADS=1 each" in result.stdout
    for i, preset in enumerate(presets, 1):
        assert f"== [{i}/3] {preset}: completed" in result.stdout
        assert "done: {" in open(runs / preset / "train.log").read()
        assert not (one_runs / preset / "train.log").exists()
    one, two = report_rows(one_runs), report_rows(runs)
    assert sorted(two) == sorted(presets)  # in the order the runs started: side by side, either way
    for preset in presets:  # all but tokens/s and the optimizer's share of the time
        assert one[preset][:4] + one[preset][6:] == two[preset][:4] + two[preset][6:]
        losses = [[(r.get("train_loss"), r.get("val_loss")) for r in map(json.loads, open(folder / preset
                                                                                        / "metrics.jsonl"))]
                  for folder in (one_runs, runs)]
        assert losses[0] == losses[1] and len(losses[0]) >= 6


@pytest.mark.parametrize("flags, message", [
    (["--no-such-flag"], "error: unrecognized arguments: --no-such-flag"),
    (["--n-head", "3"], "error: --n-embd 32 is not divisible by --n-head 3"),
    (["--data-dir", "/nonexistent"], "error: --data-dir /nonexistent does not exist"),
])
def test_a_train_flag_mistake_stops_before_any_run_once(flags, message, data_dir, tmp_path):
    # checked once for all planned runs: one error line, no run started, no folder made
    result = run_sh(tmp_path, "assign", "hetero", "all-stiefel", "--data-dir", data_dir, "--vocab-size", "64",
                    *TINY, *flags, "--jobs", "2")
    assert result.returncode == 2 and not (tmp_path / "runs").exists()
    errors = [line for line in result.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0].startswith(message), result.stderr
    assert "== [1/2]" not in result.stdout


def test_a_bad_spec_is_one_error_and_help_shows_the_trainers(data_dir, tmp_path):
    result = run_sh(tmp_path, "assign", "hetero", "attn=nonsense", "--data-dir", data_dir, *TINY)
    assert result.returncode == 2 and result.stderr.count("error:") == 1 and "attn=nonsense" in result.stderr
    assert not (tmp_path / "runs").exists()
    result = run_sh(tmp_path, "assign", "hetero", "--data-dir", data_dir, "--help")
    assert result.returncode == 0 and "usage: train_gpt2.py" in result.stdout and not (tmp_path / "runs").exists()


def test_a_run_that_starts_alone_gets_all_the_cores(data_dir, tmp_path):
    # OMP_NUM_THREADS unset: two runs side by side get half the cores each; a rerun where one is
    # already completed starts the other alone, on every core
    cores = len(os.sched_getaffinity(0))
    args = ("assign", "hetero", "unconstrained", "--data-dir", data_dir, "--vocab-size", "64", *TINY, "--jobs", "2")
    result = run_sh(tmp_path, *args, OMP_NUM_THREADS="")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count(f"OMP_NUM_THREADS={max(1, cores // 2)})") == 2, result.stdout
    os.rename(tmp_path / "runs" / "unconstrained", tmp_path / "first")
    result = run_sh(tmp_path, *args, OMP_NUM_THREADS="")
    assert result.returncode == 0 and "hetero: already completed" in result.stdout
    assert f"unconstrained -> {tmp_path / 'runs' / 'unconstrained'} (output: " in result.stdout
    assert f"OMP_NUM_THREADS={cores})" in result.stdout, result.stdout
