"""Checkpoints, exact resume, interruption, divergence and hostile input."""
import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest

from synthetic import TINY_MODEL, make_shards, trainer_in_process

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "train_gpt2.py")
RUN = [*TINY_MODEL, "--max-steps", "30", "--eval-every", "10", "--eval-tokens", "512", "--warmup-steps", "3",
       "--lr", "3e-3", "--muon-lr", "0.05", "--assign", "hetero", "--ckpt-every", "4"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return make_shards(str(tmp_path_factory.mktemp("data")))


def command(nproc, *args):
    if nproc == 1:
        return [sys.executable, TRAIN, *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", TRAIN, *args]


def run(data_dir, out_dir, *extra, nproc=1):
    return subprocess.run(command(nproc, "--data-dir", data_dir, "--out-dir", str(out_dir), *RUN, *extra),
                          capture_output=True, text=True, timeout=600, env=ENV)


def rows(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def train_losses(out_dir):
    return [(r["step"], r["train_loss"]) for r in rows(out_dir) if "train_loss" in r]


def resumed_steps(result):
    """(the step a process resumed from, the steps it trained), read from its own output: its
    `resuming from ... at step N` line and a progress line per step (it must be run with
    --log-every 1). A restart from step 0 that only says it resumed trains steps 1..N again."""
    lines = result.stdout.splitlines()
    resumed = [int(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("resuming from ")]
    trained = [int(line.split()[1].split("/")[0]) for line in lines if line.startswith("step ") and "/" in line.split()[1]]
    return (resumed[0] if len(resumed) == 1 else None), trained


def assert_resumed(result, checkpoint_step, last=30):
    """The process resumed at `checkpoint_step` (its checkpoint's) and trained only the steps after it."""
    assert resumed_steps(result) == (checkpoint_step, list(range(checkpoint_step + 1, last + 1))), result.stdout


def start_then(data_dir, out_dir, until, nproc=1, *extra):
    """Start a run in the background and return it once `until(out_dir)` holds."""
    proc = subprocess.Popen(command(nproc, "--data-dir", data_dir, "--out-dir", str(out_dir), *RUN, *extra),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
                            start_new_session=True)
    deadline = time.time() + 300
    while not until(out_dir):
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline
        time.sleep(0.05)
    return proc


def has_rows(n):
    def check(out_dir):
        path = os.path.join(out_dir, "metrics.jsonl")
        return os.path.exists(path) and sum(1 for line in open(path) if "train_loss" in line) >= n
    return check


def has_checkpoint(step):
    return lambda out_dir: os.path.exists(os.path.join(out_dir, f"ckpt_{step:08d}.pt"))


@pytest.fixture(scope="module")
def straight(data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("straight")
    result = run(data_dir, out)
    assert result.returncode == 0, result.stderr
    return out


def test_sigterm_then_resume_is_bitwise_identical(data_dir, straight, tmp_path):
    proc = start_then(data_dir, tmp_path, has_rows(7))
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 4, err  # documented: interrupted, checkpoint written
    summary = json.load(open(tmp_path / "summary.json"))
    assert summary["status"] == "interrupted" and summary["steps"] < 30
    assert os.path.exists(tmp_path / f"ckpt_{summary['steps']:08d}.pt")
    result = run(data_dir, tmp_path, "--resume", "auto", "--log-every", "1")
    assert result.returncode == 0, result.stderr
    assert_resumed(result, summary["steps"])
    assert train_losses(tmp_path) == train_losses(straight)  # each step once, same bits
    assert json.load(open(tmp_path / "summary.json"))["final_val_loss"] == \
        json.load(open(straight / "summary.json"))["final_val_loss"]


def test_resume_auto_without_a_checkpoint_starts_afresh_so_one_command_starts_and_resumes(data_dir, straight,
                                                                                         tmp_path):
    """The same command line for the first start and every restart: --resume auto in an empty folder
    (or none) starts the run and says so; in a folder whose run was killed before its first
    checkpoint it starts again from step 1, each step logged once."""
    result = run(data_dir, tmp_path / "new", "--resume", "auto")
    assert result.returncode == 0, result.stderr
    assert f"--resume auto: no checkpoint in --out-dir {tmp_path / 'new'}: starting afresh" in result.stdout
    assert json.load(open(tmp_path / "new" / "summary.json"))["status"] == "completed"
    assert train_losses(tmp_path / "new") == train_losses(straight)
    proc = start_then(data_dir, tmp_path / "killed", has_rows(3), 1, "--resume", "auto", "--ckpt-every", "0")
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not list((tmp_path / "killed").glob("ckpt_*"))
    result = run(data_dir, tmp_path / "killed", "--resume", "auto", "--ckpt-every", "0", "--log-every", "1")
    assert result.returncode == 0, result.stderr
    assert "starting afresh" in result.stdout and resumed_steps(result) == (None, list(range(1, 31)))
    assert train_losses(tmp_path / "killed") == train_losses(straight)


def test_keep_ckpts_keeps_the_newest_and_their_manifests(data_dir, tmp_path):
    result = run(data_dir, tmp_path, "--keep-ckpts", "3")  # checkpoints at 4, 8, ..., 28 and the final 30
    assert result.returncode == 0, result.stderr
    names = sorted(p.name for p in tmp_path.glob("ckpt_*"))
    assert names == [f"ckpt_{s:08d}.pt{m}" for s in (24, 28, 30) for m in ("", ".sha256")]


@pytest.mark.parametrize("flags, changed", [
    (["--n-layer", "2"], "--n-layer (1 there, 2 now)"),
    (["--assign", "all-stiefel"], "--assign (hetero there, all-stiefel now)"),
    (["--total-batch-size", "16"], "--total-batch-size (8 there, 16 now)"),
])
def test_resuming_with_another_model_assignment_or_total_batch_is_refused(data_dir, straight, tmp_path, flags,
                                                                         changed):
    before = {p: os.path.getmtime(straight / p) for p in os.listdir(straight)}
    result = trainer_in_process("--data-dir", data_dir, "--out-dir", tmp_path, *RUN, "--resume",
                                straight / "ckpt_00000030.pt", *flags)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cannot resume: the checkpoint was written with a "
                                                   "different ") and changed in lines[0], result.stderr
    assert not (tmp_path / "config.json").exists() and not (tmp_path / "metrics.jsonl").exists()
    assert {p: os.path.getmtime(straight / p) for p in os.listdir(straight)} == before


def test_sigkill_after_checkpoint_then_resume_is_bitwise_identical(data_dir, straight, tmp_path):
    proc = start_then(data_dir, tmp_path, has_checkpoint(8))
    time.sleep(0.3)  # let it run past the checkpoint: those steps are lost and redone
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    newest = int(sorted(tmp_path.glob("ckpt_*.pt"))[-1].name[5:13])
    result = run(data_dir, tmp_path, "--resume", "auto", "--log-every", "1")
    assert result.returncode == 0, result.stderr
    assert_resumed(result, newest)
    losses = train_losses(tmp_path)
    assert [s for s, _ in losses] == list(range(1, 31))
    assert losses == train_losses(straight)


def test_a_graph_replayed_run_killed_and_resumed_trains_as_the_eager_one(data_dir, tmp_path):
    """--cuda-graph on (emulated on CPU): the lr tensors go into checkpoints and come back; the
    resumed process captures its own graph; every step equals the eager sync-free run's."""
    graph = ["--solver-opt", "capturable=on", "--cuda-graph", "on"]
    eager = run(data_dir, tmp_path / "eager", "--solver-opt", "capturable=on")
    assert eager.returncode == 0, eager.stderr
    proc = start_then(data_dir, tmp_path / "graph", has_checkpoint(8), 1, *graph)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    newest = int(sorted((tmp_path / "graph").glob("ckpt_*.pt"))[-1].name[5:13])
    result = run(data_dir, tmp_path / "graph", "--resume", "auto", "--log-every", "1", *graph)
    assert result.returncode == 0, result.stderr
    assert_resumed(result, newest)
    assert train_losses(tmp_path / "graph") == train_losses(tmp_path / "eager")


def killed_after_two_checkpoints(data_dir, out_dir):
    """SIGKILL a run once it has written ckpt 12; (newest, the one before) as it left them (a loaded
    machine may have let it write more before the kill arrived)."""
    proc = start_then(data_dir, out_dir, has_checkpoint(12))
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    newest, before = sorted(out_dir.glob("ckpt_*.pt"))[-1:-3:-1]
    return newest, before


def test_truncated_newest_checkpoint_is_skipped(data_dir, straight, tmp_path):
    newest, before = killed_after_two_checkpoints(data_dir, tmp_path)
    os.truncate(newest, os.path.getsize(newest) // 2)
    result = run(data_dir, tmp_path, "--resume", "auto", "--log-every", "1")
    assert result.returncode == 0, result.stderr
    assert "skipping" in result.stdout and newest.name in result.stdout
    assert "resuming from" in result.stdout and before.name in result.stdout
    assert_resumed(result, int(before.name[5:13]))
    assert train_losses(tmp_path) == train_losses(straight)


def test_two_ranks_sigterm_resume_and_resume_on_one_rank(data_dir, tmp_path):
    two = tmp_path / "two"
    result = run(data_dir, two, "--batch-size", "4", nproc=2)
    assert result.returncode == 0, result.stderr
    cut = tmp_path / "cut"
    proc = start_then(data_dir, cut, has_rows(6), 2, "--batch-size", "4")
    proc.send_signal(signal.SIGTERM)  # torchrun forwards it to both ranks
    proc.communicate(timeout=120)
    summary = json.load(open(cut / "summary.json"))
    assert summary["status"] == "interrupted"
    # a copy of the interrupted run, resumed on one process with the same global batch
    one = tmp_path / "one"
    one.mkdir()
    for name in os.listdir(cut):
        (one / name).write_bytes((cut / name).read_bytes())
    result = run(data_dir, cut, "--resume", "auto", "--batch-size", "4", "--log-every", "1", nproc=2)
    assert result.returncode == 0, result.stderr
    # a restart from step 1 reproduces the same losses: only the process's own lines tell it resumed
    assert_resumed(result, summary["steps"])
    assert train_losses(cut) == train_losses(two)
    assert json.load(open(cut / "summary.json"))["replica_max_abs_diff"] == 0.0
    result = run(data_dir, one, "--resume", "auto", "--batch-size", "4", "--log-every", "1")  # accumulation 2
    assert result.returncode == 0, result.stderr
    assert_resumed(result, summary["steps"])
    assert [s for s, _ in train_losses(one)] == [s for s, _ in train_losses(two)] == list(range(1, 31))
    for (_, a), (_, b) in zip(train_losses(one), train_losses(two), strict=True):
        assert abs(a - b) <= 1e-4 * abs(b)


def test_divergence_is_recorded_with_its_own_exit_status(data_dir, tmp_path):
    result = run(data_dir, tmp_path, "--lr", "30", "--muon-lr", "2", "--warmup-steps", "0", "--eval-every", "2")
    assert result.returncode == 3, result.stdout[-2000:] + result.stderr[-2000:]
    summary = json.load(open(tmp_path / "summary.json"))
    assert summary["status"] == "diverged"
    step = summary["diverged"]["step"]
    assert step < 30 and os.path.exists(tmp_path / f"diverged_{step:08d}.pt")
    assert {"train_loss", "lr", "grad_norm", "param_max_abs", "max_manifold_violation"} <= set(summary["diverged"])
    again = run(data_dir, tmp_path / "c", "--lr", "30", "--muon-lr", "2", "--warmup-steps", "0",
                "--eval-every", "2", "--on-diverge", "continue")
    assert again.returncode == 0
    summary = json.load(open(tmp_path / "c" / "summary.json"))
    assert summary["status"] == "completed" and summary["diverged"]["step"] == step


@pytest.mark.parametrize("flags, message", [
    (["--assign", "hetro"], "unknown --assign"),
    (["--lr", "0"], "--lr must be positive"),
    (["--muon-lr", "-0.1"], "--muon-lr must be positive"),
    (["--n-embd", "30", "--n-head", "4"], "not divisible"),
    (["--seq-len", "30000"], "fewer than one batch"),
    (["--resume", "/nonexistent/ckpt.pt"], "no such checkpoint"),
    (["--out-dir", "/proc/forbidden"], "--out-dir /proc/forbidden"),  # root may write anywhere else
    (["--out-dir", ROOT + "/README.md/run"], "is not a directory"),
    (["--assign", "attn.x=stiefel"], "unknown module 'attn.x'"),
    (["--dgram-cap", "0"], "--dgram-cap must be positive"),
    (["--assign", "auto", "--auto-base", "auto"], "--auto-base must be"),
    (["--assign", "auto", "--auto-logit-max", "-1"], "--auto-logit-max must be non-negative"),
])
def test_hostile_input_is_one_clean_error_line(data_dir, tmp_path, flags, message):
    result = trainer_in_process("--data-dir", data_dir, "--out-dir", tmp_path / "o", *RUN, *flags)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.stderr
    assert not (tmp_path / "o" / "metrics.jsonl").exists()


def test_missing_data_dir_and_foreign_run_are_refused_without_touching_anything(data_dir, tmp_path, straight):
    result = subprocess.run(command(1, "--data-dir", str(tmp_path / "nothing"), "--out-dir", str(tmp_path / "o"),
                                    *RUN), capture_output=True, text=True, timeout=120, env=ENV)
    assert result.returncode == 2 and "does not exist" in result.stderr
    before = {p: os.path.getmtime(straight / p) for p in os.listdir(straight)}
    result = run(data_dir, straight)  # another run into a folder that holds one
    assert result.returncode == 2 and "holds another run" in result.stderr
    assert {p: os.path.getmtime(straight / p) for p in os.listdir(straight)} == before
    result = run(data_dir, tmp_path / "fresh", "--max-steps", "2")
    assert result.returncode == 0
    result = run(data_dir, tmp_path / "fresh", "--max-steps", "2", "--overwrite")
    assert result.returncode == 0 and len(train_losses(tmp_path / "fresh")) == 2


def test_blown_up_weights_report_a_nan_violation():
    # a divergence record must not say "on the manifold" (0.0) for NaN weights: max() drops NaN
    import types

    import torch

    import train_gpt2
    eye, nan = torch.eye(8), torch.full((8, 8), float("nan"))
    plan = [(n, w, "attn.proj", [(n, 0, 8, "stiefel")]) for n, w in (("a", eye), ("b", nan), ("c", eye))]
    assert math.isnan(train_gpt2.max_violations(plan, types.SimpleNamespace(dgram_cap=1.0))["stiefel"])


def tensors_differing(a, b, path=""):
    """Paths of the tensors (nested dicts and lists) that are not bitwise equal in `a` and `b`."""
    import torch
    if isinstance(a, torch.Tensor):
        return [] if isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b) else [path]
    if isinstance(a, dict):
        if set(a) != set(b):
            return [f"{path} keys"]
        return [d for k in a for d in tensors_differing(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, (list, tuple)):
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in tensors_differing(x, y, f"{path}[{i}]")]
    return [] if a == b else [path]


def saved_state(out_dir, step, fsdp):
    """(weights, optimizer states) of checkpoint `step`: Muon's and AdamW's state (their groups'
    lr is the schedule's, step by step); a DCP folder (--fsdp) read into one dict."""
    import torch
    if not fsdp:
        ckpt = torch.load(out_dir / f"ckpt_{step:08d}.pt", weights_only=False)
        return ckpt["model"], [ckpt["muon"]["state"], ckpt["adamw"]["state"]]
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    dcp_to_torch_save(out_dir / f"ckpt_{step:08d}.dcp", out_dir / f"whole_{step}.pt")
    ckpt = torch.load(out_dir / f"whole_{step}.pt", weights_only=False)
    return ckpt["model"], [{k: v for k, v in ckpt["optim"].items() if "param_groups" not in k}]


@pytest.mark.parametrize("mode", ["one-process", "ddp", "fsdp", "graph"])
def test_a_nan_gradient_step_is_skipped_leaving_weights_and_optimizer_state_bitwise(data_dir, tmp_path, mode):
    """One NaN in one gradient at step 4: steps 3 and 4 end with the same weights and optimizer
    state, bit for bit (Muon's momenta and warm starts, AdamW's moments and step count); steps 5
    and 6 train; metrics.jsonl and the summary count the skip. DDP on 2 ranks (the NaN on every
    rank, as the all-reduce would spread it); --fsdp in one process: its sharded
    Muon step and DTensor AdamW; graph: the sync-free Muon step replayed from the graph captured at
    step 3 (--cuda-graph on, emulated on CPU)."""
    import torch
    fsdp = mode == "fsdp"
    flags = {"one-process": [], "ddp": ["--batch-size", "4"], "fsdp": ["--fsdp"],
             "graph": ["--solver-opt", "capturable=on", "--cuda-graph", "on"]}
    result = subprocess.run(command(2 if mode == "ddp" else 1, "--data-dir", data_dir, "--out-dir", str(tmp_path), *RUN, "--max-steps", "6",
                                    "--ckpt-every", "1", "--keep-ckpts", "10", "--eval-every", "100", *flags[mode]),
                            capture_output=True, text=True, timeout=600, env={**ENV, "MMUON_NAN_GRAD_STEPS": "4"})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "step      4: gradient norm nan: step skipped" in result.stderr
    state = {s: saved_state(tmp_path, s, fsdp) for s in (3, 4, 5, 6)}
    assert not tensors_differing(state[3], state[4]), tensors_differing(state[3], state[4])
    assert all(optimizer for optimizer in state[3][1])  # there is state to keep
    for later in (5, 6):  # the next steps train, from finite weights
        moved = tensors_differing(state[later - 1][0], state[later][0])
        assert len(moved) == len(state[later][0])
        assert all(torch.isfinite(v).all() for v in state[later][0].values())
    steps = {r["step"]: r for r in rows(tmp_path) if "train_loss" in r}
    assert [steps[s]["skipped"] for s in range(1, 7)] == [False, False, False, True, False, False]
    assert [steps[s]["skipped_steps"] for s in range(1, 7)] == [0, 0, 0, 1, 1, 1]
    assert math.isfinite(steps[6]["train_loss"])
    summary = json.load(open(tmp_path / "summary.json"))
    assert summary["status"] == "completed" and summary["skipped_steps"] == 1 and summary["diverged"] is None


def test_non_finite_steps_in_a_row_stop_the_run_with_an_error_counting_across_a_resume(data_dir, tmp_path):
    """Skips at steps 2, 4 and 5 (two in a row) end a 5-step run; its checkpoint keeps both counts,
    so the resumed run's skip at step 6 is the third in a row and stops it."""
    first = subprocess.run(command(1, "--data-dir", data_dir, "--out-dir", str(tmp_path), *RUN, "--max-steps", "5",
                                   "--ckpt-every", "5", "--max-skipped-steps", "3"),
                           capture_output=True, text=True, timeout=600, env={**ENV, "MMUON_NAN_GRAD_STEPS": "2,4,5"})
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    result = subprocess.run(command(1, "--data-dir", data_dir, "--out-dir", str(tmp_path), *RUN, "--max-steps", "8",
                                    "--max-skipped-steps", "3", "--resume", "auto"),
                            capture_output=True, text=True, timeout=600, env={**ENV, "MMUON_NAN_GRAD_STEPS": "6"})
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: 3 steps in a row (steps 4-6) had a non-finite gradient norm and were skipped "
                      "(--max-skipped-steps 3); the weights are those after step 3. Lower --lr / --muon-lr, check "
                      "the data, or resume from a checkpoint"], result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert [(r["step"], r["skipped_steps"]) for r in rows(tmp_path) if "train_loss" in r] == \
        [(1, 0), (2, 1), (3, 1), (4, 2), (5, 3), (6, 4)]


@pytest.mark.parametrize("bad", ["nan", "inf", "overflow"])
def test_a_non_finite_norm_makes_every_gradient_nan_and_a_finite_one_clips_as_torch(bad):
    """clip_or_mark: an overflowing norm of finite entries (inf) must not clip to zero gradients
    (a step that still moves the weights through the momentum) but mark every gradient."""
    import torch

    from training.nonfinite import clip_or_mark
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(4))]
    for p in params:
        p.grad = torch.randn_like(p)
    expected = [p.grad.clone() for p in params]
    reference = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for r, g in zip(reference, expected):
        r.grad = g.clone()
    torch_norm = torch.nn.utils.clip_grad_norm_(reference, 0.5)
    got_norm, finite = clip_or_mark(params, 0.5)
    assert bool(finite) and torch.equal(got_norm, torch_norm)
    assert all(torch.equal(p.grad, r.grad) for p, r in zip(params, reference))
    value = {"nan": float("nan"), "inf": float("inf"), "overflow": 1e30}[bad]
    params[1].grad[2] = value
    if bad == "overflow":
        params[0].grad.fill_(1e30)  # every entry finite, the squares' sum is not
    got_norm, finite = clip_or_mark(params, 0.5)
    assert not bool(finite) and not torch.isfinite(got_norm)
    assert all(torch.isnan(p.grad).all() for p in params)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("first", [False, True])
def test_adamw_step_on_a_non_finite_flag_keeps_parameters_and_state_bitwise(fused, first):
    """training.nonfinite.adamw_step, both gates: fused AdamW's found_inf and the torch.where one;
    on the first step too, where the step creates the state."""
    import torch

    from training.nonfinite import adamw_step
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(6, 4)), torch.nn.Parameter(torch.randn(4))]
    adamw = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=fused)
    for _ in range(0 if first else 2):
        for p in params:
            p.grad = torch.randn_like(p)
        adamw_step(adamw, torch.tensor(True))
    before = [p.detach().clone() for p in params]
    state = {id(p): {k: v.clone() for k, v in adamw.state[p].items()} for p in params if p in adamw.state}
    for p in params:
        p.grad = torch.full_like(p, float("nan"))
    adamw_step(adamw, torch.tensor(False))
    assert all(torch.equal(p.detach(), b) for p, b in zip(params, before))
    for p in params:
        kept = state.get(id(p), {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                                 "exp_avg_sq": torch.zeros_like(p)})
        assert set(adamw.state[p]) == set(kept)
        assert all(torch.equal(adamw.state[p][k], v) for k, v in kept.items()), (p.shape, adamw.state[p])
    # and the next finite step is the one an AdamW that never saw the skipped step takes
    twin = [torch.nn.Parameter(b.clone()) for b in before]
    reference = torch.optim.AdamW(twin, lr=1e-2, weight_decay=0.1, fused=fused)
    if state:
        reference.load_state_dict({"state": {i: state[id(p)] for i, p in enumerate(params)},
                                   "param_groups": adamw.state_dict()["param_groups"]})
    for p, t in zip(params, twin):
        p.grad = torch.ones_like(p)
        t.grad = torch.ones_like(t)
    adamw_step(adamw, torch.tensor(True))
    reference.step()
    assert all(torch.equal(p.detach(), t.detach()) for p, t in zip(params, twin))


@pytest.mark.parametrize("fused", [False, True])
def test_the_skip_gate_reads_nothing_on_the_host(fused):
    """clip_or_mark, adamw_step and forget_logits add no host read (no device sync) to a step:
    counted by bench.op_count.HostReads, against torch's own clip and AdamW step (the
    unfused AdamW reads its step count on the host by itself)."""
    import torch

    from bench.op_count import HostReads
    from training.nonfinite import adamw_step, clip_or_mark, forget_logits

    class Attention:
        logit_max = torch.zeros(2)

    qk_clip = type("QKClip", (), {"attentions": [Attention()]})()

    def step(gated, bad):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(6, 4)), torch.nn.Parameter(torch.randn(4))]
        adamw = torch.optim.AdamW(params, lr=1e-2, fused=fused)
        counts = []
        for value in (1.0, bad):
            for p in params:
                p.grad = torch.full_like(p, value)
            with HostReads() as reads:
                if gated:
                    _, finite = clip_or_mark(params, 1.0)
                    adamw_step(adamw, finite)
                    forget_logits(qk_clip, finite)
                else:
                    torch.nn.utils.clip_grad_norm_(params, 1.0)
                    adamw.step()
            counts.append(reads.count)
        return counts

    for bad in (float("nan"), float("inf")):
        assert step(True, bad) == step(False, bad), bad
