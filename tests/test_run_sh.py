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


def test_quick_runs_the_five_presets_and_writes_the_report(data_dir, tmp_path):
    result = run_sh(tmp_path, "quick", "--data-dir", data_dir, "--vocab-size", "64", *TINY)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    runs = tmp_path / "runs"
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


def test_assign_records_divergence_goes_on_and_keeps_finished_runs(data_dir, tmp_path):
    wild = ["--lr", "30", "--muon-lr", "2", "--warmup-steps", "0", "--max-steps", "30"]
    result = run_sh(tmp_path, "assign", "hetero", "attn=dgram,mlp=none", "--data-dir", data_dir,
                    "--vocab-size", "64", *TINY, *wild)
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
    assert "no network" in result.stdout and "data/prepare.py --files" in result.stdout
    config = json.load(open(tmp_path / "runs" / "hetero" / "config.json"))
    assert config["data_dir"] == str(tmp_path / "data" / "sample_books") and config["vocab_size"] == 50304


@pytest.mark.parametrize("args, message", [
    (["quick", "--out-dir", "x"], "set RUNS_DIR instead"),
    (["quick", "--assign", "hetero"], "bash run.sh assign"),
    (["assign", "--max-steps", "3"], "no SPEC given"),
    (["nonsense"], "usage: bash run.sh"),
])
def test_mistakes_are_one_clean_line(args, message, tmp_path):
    result = run_sh(tmp_path, *args)
    assert result.returncode == 2 and message in result.stderr and not (tmp_path / "runs").exists()


def test_assign_paper_runs_under_torchrun(data_dir, tmp_path):
    # the paper setting's launcher, on 2 CPU processes; its --compile and wandb undone by flags
    result = run_sh(tmp_path, "assign", "--paper", "hetero", "--data-dir", data_dir, "--vocab-size", "64", *TINY,
                    "--no-compile", "--wandb", "off", NPROC="2")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    config = json.load(open(tmp_path / "runs" / "hetero" / "config.json"))
    assert config["world_size"] == 2 and config["batch_size"] == 4 and config["compile"] is False
    assert config["n_layer"] == 1 and config["wandb"] == "off"
    assert report_rows(tmp_path / "runs")["hetero"][2] == "4"


def test_ctrl_c_stops_the_ablation_and_a_rerun_resumes(data_dir, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SKIP_SETUP": "1", "VENV": sys.prefix,
           "RUNS_DIR": str(tmp_path / "runs")}
    args = ["assign", "hetero", "unconstrained", "--data-dir", data_dir, "--vocab-size", "64", *TINY,
            "--max-steps", "60", "--ckpt-every", "5"]
    proc = subprocess.Popen(["bash", os.path.join(ROOT, "run.sh"), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    first = tmp_path / "runs" / "hetero" / "ckpt_00000010.pt"
    deadline = time.time() + 120
    while not first.exists():
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the whole foreground group
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 4, out[-2000:] + err[-2000:]
    assert "hetero: interrupted" in out and not (tmp_path / "runs" / "unconstrained").exists()
    again = run_sh(tmp_path, *args)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert "hetero -> " in again.stdout and "--resume auto" in again.stdout
    for name in ("hetero", "unconstrained"):
        summary = json.load(open(tmp_path / "runs" / name / "summary.json"))
        assert summary["status"] == "completed" and summary["steps"] == 60
