"""train_gpt2.py --fsdp on 2 gloo ranks: the same training as DDP (with gradient accumulation, and
HSDP's replicated groups), DCP checkpoints that resume on 2 and 3 ranks (--fsdp) and on 1 (unsharded), a
corrupt shard file refused, a killed rank restarted by torchrun.

The launches are shared by the checks (a module fixture): per assignment one --fsdp run (30 steps,
a checkpoint every 15) and one DDP run. hetero and hetero-inv between them put Stiefel and DGram on
every shape (attention's and the MLP's, both orientations). hetero's runs take 12 sequences a step, so
that its step-15 checkpoint resumes on 3 ranks (uneven shards) as well as on 2 with --fsdp and on 1
without; a --resume auto over a copy whose step-30 checkpoint has a corrupt shard file."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from synthetic import make_shards

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ASSIGNS = ["hetero", "hetero-inv"]
RUN = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--seq-len", "32", "--vocab-size", "64",
       "--total-batch-size", "8", "--device", "cpu", "--wandb", "off", "--log-every", "1000", "--max-steps", "30",
       "--warmup-steps", "5", "--lr", "3e-3", "--min-lr", "3e-4", "--muon-lr", "0.05", "--eval-every", "30",
       "--eval-tokens", "1024"]


def launch(nproc, data_dir, out_dir, *extra, expect_ok=True, restarts=0, env=None, total=12):
    """`total` sequences a step (replacing RUN's 8), one micro-batch per rank unless `extra` says
    otherwise: hetero's 12 are 6 a rank on 2 ranks, 4 on 3 and 12 on 1."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    args = ["--data-dir", data_dir, "--out-dir", str(out_dir), *RUN, "--total-batch-size", str(total),
            "--batch-size", str(total // nproc), *extra]
    script = os.path.join(ROOT, "train_gpt2.py")
    cmd = ([sys.executable, script, *args] if nproc == 1 else
           [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            f"--max-restarts={restarts}", script, *args])
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    if expect_ok:
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result


def train_losses(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return {row["step"]: row["train_loss"] for row in map(json.loads, f) if "train_loss" in row}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp")
    data = make_shards(str(root / "data"))
    out = {"root": root}
    for assign in ASSIGNS:
        # hetero-inv with gradient accumulation under --fsdp (2 micro-steps of 2 sequences per rank)
        total, accumulate = (8, ["--batch-size", "2"]) if assign == "hetero-inv" else (12, [])
        launch(2, data, root / f"fsdp-{assign}", "--assign", assign, "--fsdp", "--ckpt-every", "15", *accumulate,
               total=total)
        launch(2, data, root / f"ddp-{assign}", "--assign", assign, "--ckpt-every", "15", total=total)
    # HSDP: replicated over 2 groups of 1 rank (the groups' gradient all-reduce, each rank its own owner)
    launch(2, data, root / "hsdp-hetero", "--fsdp", "--fsdp-shard-ranks", "1")
    step15 = str(root / "fsdp-hetero" / "ckpt_00000015.dcp")
    launch(2, data, root / "resumed-fsdp", "--fsdp", "--resume", step15)
    launch(1, data, root / "resumed-one", "--resume", step15)
    launch(3, data, root / "resumed-three", "--fsdp", "--resume", step15)  # 2 ranks -> 3: uneven shards
    # the other way: a DDP run's one-file checkpoint, its whole state sharded on load
    launch(2, data, root / "resumed-from-ddp", "--fsdp", "--resume", str(root / "ddp-hetero" / "ckpt_00000015.pt"))
    corrupt = root / "corrupt"
    shutil.copytree(root / "fsdp-hetero", corrupt)
    shard = corrupt / "ckpt_00000030.dcp" / "__1_0.distcp"
    data_bytes = bytearray(shard.read_bytes())
    data_bytes[len(data_bytes) // 2] ^= 0xFF
    shard.write_bytes(bytes(data_bytes))
    os.remove(corrupt / "summary.json")
    out["corrupt"] = launch(2, data, corrupt, "--fsdp", "--resume", "auto")
    # rank 1 SIGKILLs itself after step 20 (the trainer's test-only hook) in torchrun's first attempt;
    # --max-restarts 1 reruns the command, which resumes from checkpoint 15
    out["killed"] = launch(2, data, root / "killed", "--assign", "hetero", "--fsdp", "--ckpt-every", "15",
                           "--resume", "auto", "--log-every", "1", restarts=1,
                           env={"MMUON_FAULT_STEP": "20", "MMUON_FAULT_RANK": "1"})
    return out


# hetero-inv runs --fsdp with gradient accumulation: its gradients round differently from DDP's (~1e-7),
# and a matrix sign lifts a rank-deficient momentum's noise directions (the online scheme's polar
# factor, as plain Muon's msign; sharpen lifts them further): measured over 30 steps, losses 3.5e-4 and
# the eval's largest singular values 2.5e-3 apart (all-dgram, which this pair replaced: losses 4.9e-3;
# ADMM, whose clip lifts nothing, 4.8e-7). hetero, without accumulation, is bitwise DDP's (0 measured).
# A sync error would move the loss by ~1e-1.
GAP = {"hetero": 1e-4, "hetero-inv": 1e-2}


@pytest.mark.parametrize("assign", ASSIGNS)
def test_fsdp_trains_as_ddp(runs, assign):
    fsdp, ddp = (train_losses(runs["root"] / f"{kind}-{assign}") for kind in ("fsdp", "ddp"))
    assert sorted(fsdp) == sorted(ddp) == list(range(1, 31))
    gap = max(abs(fsdp[s] - ddp[s]) for s in ddp)
    print(f"{assign}: --fsdp vs DDP, 2 ranks, 30 steps: largest train-loss difference {gap:.1e}")
    assert gap <= GAP[assign]
    with open(runs["root"] / f"fsdp-{assign}" / "summary.json") as f:
        summary = json.load(f)
    assert summary["status"] == "completed" and max(summary["max_manifold_violation"].values()) <= 1e-4
    # config.json counts what a rank receives under --fsdp too (FSDP's collectives + the exchange)
    configs = [json.load(open(runs["root"] / f"{kind}-{assign}" / "config.json")) for kind in ("fsdp", "ddp")]
    assert configs[0]["comm_bytes_per_step"] > 0 and configs[1]["comm_bytes_per_step"] > 0
    # the eval's weight diagnostics (each matrix gathered whole under --fsdp) are DDP's
    evals = [[row for row in map(json.loads, open(runs["root"] / f"{kind}-{assign}" / "metrics.jsonl"))
              if "val_loss" in row][-1] for kind in ("fsdp", "ddp")]
    for field in ("sigma_max", "sigma_min", "manifold_violation"):
        assert evals[0][field].keys() == evals[1][field].keys(), field
    assert len(evals[0]["attn_logit_max"]) == len(evals[1]["attn_logit_max"]) == 2
    assert max(abs(evals[0]["sigma_max"][k] - evals[1]["sigma_max"][k]) for k in evals[1]["sigma_max"]) <= GAP[assign]
    folders = sorted(os.listdir(runs["root"] / f"fsdp-{assign}"))
    assert [f for f in folders if f.endswith(".dcp")] == ["ckpt_00000015.dcp", "ckpt_00000030.dcp"]
    assert not [f for f in folders if f.endswith(".tmp")]


def test_hsdp_trains_as_ddp(runs):
    hsdp, ddp = (train_losses(runs["root"] / f"{kind}-hetero") for kind in ("hsdp", "ddp"))
    assert sorted(hsdp) == list(range(1, 31)) and max(abs(hsdp[s] - ddp[s]) for s in ddp) <= 1e-4


# (the run that saved the step-15 checkpoint, the run that resumed it)
RESUMES = {"an fsdp checkpoint on 2 ranks with --fsdp": ("fsdp-hetero", "resumed-fsdp"),
           "an fsdp checkpoint on 1 rank without --fsdp": ("fsdp-hetero", "resumed-one"),
           "a DDP checkpoint on 2 ranks with --fsdp": ("ddp-hetero", "resumed-from-ddp"),
           "a 2-rank fsdp checkpoint on 3 ranks": ("fsdp-hetero", "resumed-three")}


@pytest.mark.parametrize("case", RESUMES)
def test_a_checkpoint_resumes_on_another_layout_and_number_of_ranks(runs, case):
    saved, where = RESUMES[case]
    straight, resumed = train_losses(runs["root"] / saved), train_losses(runs["root"] / where)
    assert sorted(resumed) == list(range(16, 31))  # resumed at step 15, trained 16..30
    gap = max(abs(resumed[s] - straight[s]) for s in resumed)
    print(f"{case}: resumed steps 16-30 within {gap:.1e} of the straight run")
    assert gap <= 1e-4


def test_a_corrupt_shard_file_is_refused_and_the_previous_checkpoint_resumes(runs):
    result = runs["corrupt"]
    assert "skipping" in result.stdout and "__1_0.distcp" in result.stdout and "SHA-256" in result.stdout, \
        result.stdout[-2000:]
    assert "resuming from" in result.stdout and "ckpt_00000015.dcp at step 15" in result.stdout
    straight, resumed = train_losses(runs["root"] / "fsdp-hetero"), train_losses(runs["root"] / "corrupt")
    assert all(abs(resumed[s] - straight[s]) <= 1e-4 for s in range(16, 31))


def test_a_rank_killed_under_torchrun_max_restarts_resumes_and_ends_as_the_straight_run(runs):
    result = runs["killed"]
    first, second = result.stdout.split("resuming from ")
    assert "starting afresh" in first and f"step {19:6d}/30" in first, result.stdout[-3000:]
    assert second.startswith(f"{runs['root'] / 'killed' / 'ckpt_00000015.dcp'} at step 15"), second[:200]
    assert train_losses(runs["root"] / "killed") == train_losses(runs["root"] / "fsdp-hetero")  # bitwise
    with open(runs["root"] / "killed" / "summary.json") as f:
        assert json.load(f)["status"] == "completed"


def test_sample_export_and_hellaswag_read_an_fsdp_checkpoint_folder(runs):
    """training.model_io (their one loader) gathers the folder's model whole: the same weights, to the
    runs' own agreement, as the DDP run's final one-file checkpoint."""
    import torch
    from training.model_io import find_checkpoint, load_model
    path, payload = find_checkpoint(out_dir=str(runs["root"] / "fsdp-hetero"))
    assert path.endswith("ckpt_00000030.dcp") and payload["step"] == 30
    sharded = load_model(payload).state_dict()
    _, payload = find_checkpoint(checkpoint=str(runs["root"] / "ddp-hetero" / "ckpt_00000030.pt"))
    replicated = load_model(payload).state_dict()
    assert sharded.keys() == replicated.keys()
    assert max((sharded[k] - replicated[k]).abs().max().item() for k in sharded) <= 1e-4


@pytest.mark.parametrize("flags,message", [
    (["--fsdp", "--qk-clip", "50"], "--fsdp does not support --qk-clip yet"),
    (["--fsdp", "--assign", "auto"], "--fsdp does not support --assign auto yet"),
    (["--fsdp-shard-ranks", "2"], "--fsdp-shard-ranks shards within groups of ranks: it needs --fsdp"),
    (["--fsdp", "--fsdp-shard-ranks", "3"], "--fsdp-shard-ranks 3 must divide the 2 ranks"),
])
def test_what_fsdp_does_not_support_is_one_clear_error(flags, message):
    import train_gpt2
    from errors import UserError
    args = train_gpt2.parse_args(["--data-dir", "unused", *RUN, "--batch-size", "4", *flags])
    with pytest.raises(UserError, match=message):
        train_gpt2.validate_args(args, world_size=2)
