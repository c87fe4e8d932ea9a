"""Multi-process training under torchrun (gloo on CPU)."""
import json
import math
import os
import subprocess
import sys

import pytest

from synthetic import TINY_MODEL, make_shards

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def launch(nproc, out_dir, data_dir, *extra):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = ["--data-dir", data_dir, "--out-dir", str(out_dir), *TINY_MODEL, "--n-layer", "2",
            "--batch-size", "4", "--max-steps", "8", "--eval-every", "4", "--eval-tokens", "512",
            "--warmup-steps", "2", "--lr", "3e-3", "--muon-lr", "0.05", *extra]
    if nproc == 1:
        cmd = [sys.executable, os.path.join(ROOT, "train_gpt2.py"), *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               os.path.join(ROOT, "train_gpt2.py"), *args]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    rows = [json.loads(line) for line in open(os.path.join(out_dir, "metrics.jsonl"))]
    summary = json.load(open(os.path.join(out_dir, "summary.json")))
    return rows, summary


# hetero's eager fp32 runs on 1 and 2 processes, 12 steps: a pair for the world-size check and the
# references of the GPU path's flags (one launch each, shared)
HETERO_EAGER = ["--assign", "hetero", "--max-steps", "12", "--eval-every", "6"]


@pytest.fixture(scope="module")
def hetero_eager(tmp_path_factory):
    root = tmp_path_factory.mktemp("hetero-eager")
    data_dir = make_shards(str(root / "data"))
    return data_dir, {nproc: launch(nproc, root / f"eager-{nproc}", data_dir, *HETERO_EAGER) for nproc in (1, 2)}


@pytest.mark.parametrize("assign", [["hetero"], ["unconstrained"],
                                    # q, k blocks of one matrix on different ranks
                                    ["hetero-qk"],
                                    # switches at step 4 (rank 0 decides, every rank regroups)
                                    ["auto", "--auto-logit-max", "1e-3"]], ids=lambda a: a[0])
def test_two_ranks_match_one_rank_with_accumulation(assign, tmp_path, request):
    # 8 sequences per step: 2 ranks x 4, or 1 rank x 4 x accumulation 2; hetero 12 steps, the others 8
    if assign == ["hetero"]:
        _, runs = request.getfixturevalue("hetero_eager")
        (one, s1), (two, s2), steps = runs[1], runs[2], 12
    else:
        data_dir = make_shards(str(tmp_path / "data"))
        two, s2 = launch(2, tmp_path / "two", data_dir, "--assign", *assign)
        one, s1 = launch(1, tmp_path / "one", data_dir, "--assign", *assign)
        steps = 8
    # the same decisions (their reasons quote rank 0's first val batch, which differs)
    assert [(s["step"], s["layer"]) for s in s2.get("auto_switches", [])] == \
        [(s["step"], s["layer"]) for s in s1.get("auto_switches", [])]
    if assign[0] == "auto":
        assert [(s["step"], s["layer"]) for s in s2["auto_switches"]] == [(4, 0), (4, 1)]
    losses2 = [r["train_loss"] for r in two if "train_loss" in r]
    losses1 = [r["train_loss"] for r in one if "train_loss" in r]
    assert len(losses1) == len(losses2) == steps
    for a, b in zip(losses1, losses2, strict=True):
        assert abs(a - b) <= 1e-4 * abs(a), (losses1, losses2)
    val2 = [(r["step"], r["val_loss"]) for r in two if "val_loss" in r]
    val1 = [(r["step"], r["val_loss"]) for r in one if "val_loss" in r]
    assert [s for s, _ in val1] == [s for s, _ in val2] == [steps // 2, steps]  # an eval every half
    for (_, a), (_, b) in zip(val1, val2, strict=True):
        assert abs(a - b) <= 1e-4 * abs(a)
    assert s2["world_size"] == 2 and s1["world_size"] == 1
    assert s2["replica_max_abs_diff"] == 0.0
    assert all(r["replica_max_abs_diff"] == 0.0 for r in two if "val_loss" in r)
    assert s2["tokens"] == s1["tokens"]
    assert all(v <= 1e-4 for v in s2["max_manifold_violation"].values())


def without_batch_flags(flags):
    out, skip = [], False
    for flag in flags:
        if skip:
            skip = False
        elif flag in ("--batch-size", "--total-batch-size"):
            skip = True
        else:
            out.append(flag)
    return out


@pytest.mark.parametrize("nproc", [1, 2])
def test_no_batch_flags_train_the_published_64_sequences_per_step(nproc, tmp_path):
    data_dir = make_shards(str(tmp_path / "data"))
    args = ["--data-dir", data_dir, "--out-dir", str(tmp_path / "run"), *without_batch_flags(TINY_MODEL),
            "--max-steps", "1", "--eval-tokens", "256", "--warmup-steps", "1"]
    prefix = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                   f"--nproc_per_node={nproc}"]
    result = subprocess.run([*prefix, os.path.join(ROOT, "train_gpt2.py"), *args], capture_output=True, text=True,
                            timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    config = json.load(open(tmp_path / "run" / "config.json"))
    assert config["tokens_per_step"] == 64 * 32 and config["total_batch_size"] == 64
    assert config["batch_size"] == 8 and config["grad_accum"] == 8 // nproc and config["world_size"] == nproc
    assert json.load(open(tmp_path / "run" / "summary.json"))["tokens"] == 64 * 32


def test_a_total_batch_that_does_not_split_over_the_ranks_is_an_error(tmp_path):
    data_dir = make_shards(str(tmp_path / "data"))
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             os.path.join(ROOT, "train_gpt2.py"), "--data-dir", data_dir, "--out-dir",
                             str(tmp_path / "run"), *TINY_MODEL, "--total-batch-size", "12", "--batch-size", "4"],
                            capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode != 0
    assert result.stderr.count("error: --total-batch-size 12 is not a multiple of --batch-size 4 x 2 processes") == 1
    # torchrun reports a failed worker with a traceback of its own; the workers print none
    assert 'train_gpt2.py", line' not in result.stderr and not (tmp_path / "run").exists()


def losses(rows, key):
    return [r[key] for r in rows if key in r]


@pytest.mark.parametrize("nproc", [1, 2])
def test_gpu_path_flags_train_close_to_eager_fp32(nproc, tmp_path, hetero_eager):
    """--compile (inductor, here on CPU) and --dtype bfloat16 (autocast, here on CPU), the GPU
    defaults, on 1 process and under DDP: 12 steps, losses finite and close to eager fp32.

    Tolerances: inductor only reorders fp32 arithmetic (about 1e-7 per operation), so 1e-4
    relative, as between world sizes. bf16 rounds every matmul input to 8 mantissa bits (unit
    roundoff 2^-9 = 0.2%); averaged over a batch the losses move far less (1.1e-4 at most over 16
    steps, measured), so 0.2% has a margin of ten and is still a twentieth of what training does
    to the loss in these steps (about 4%), which a broken path would not track."""
    data_dir, runs = hetero_eager
    eager, _ = runs[nproc]
    compiled, s_compiled = launch(nproc, tmp_path / "compiled", data_dir, *HETERO_EAGER, "--compile")
    bf16, s_bf16 = launch(nproc, tmp_path / "bf16", data_dir, *HETERO_EAGER, "--dtype", "bfloat16")
    assert json.load(open(tmp_path / "compiled" / "config.json"))["compile"] is True
    assert json.load(open(tmp_path / "bf16" / "config.json"))["dtype_resolved"] == "bfloat16"
    reference = losses(eager, "train_loss") + losses(eager, "val_loss")
    assert reference[11] < 0.98 * reference[0]  # it learns, by ten times the bf16 tolerance
    for rows, rel in ((compiled, 1e-4), (bf16, 2e-3)):
        got = losses(rows, "train_loss") + losses(rows, "val_loss")
        assert len(got) == len(reference) == 14 and all(math.isfinite(v) for v in got)
        for a, b in zip(got, reference):
            assert abs(a - b) <= rel * abs(b), (got, reference)
    # autocast really ran in bf16: its losses are not fp32's to the bit
    assert losses(bf16, "train_loss") != losses(eager, "train_loss")
    for summary in (s_compiled, s_bf16):
        assert summary["status"] == "completed" and summary["replica_max_abs_diff"] == 0.0


def test_two_ranks_replaying_the_muon_step_from_a_graph_train_as_eager(tmp_path):
    """--cuda-graph on at 2 ranks (the replay emulated on CPU, the all-gather inside it): every
    loss to the bit as the eager sync-free step, and the replicas equal."""
    data_dir = make_shards(str(tmp_path / "data"))
    flags = ["--assign", "hetero", "--solver-opt", "capturable=on"]
    eager, _ = launch(2, tmp_path / "eager", data_dir, *flags)
    graph, summary = launch(2, tmp_path / "graph", data_dir, *flags, "--cuda-graph", "on")
    assert losses(graph, "train_loss") == losses(eager, "train_loss") and len(losses(eager, "train_loss")) == 8
    assert losses(graph, "val_loss") == losses(eager, "val_loss")
    assert summary["replica_max_abs_diff"] == 0.0
