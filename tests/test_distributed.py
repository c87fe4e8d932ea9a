"""Multi-process training under torchrun (gloo on CPU)."""
import json
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


@pytest.mark.parametrize("assign", [["hetero"], ["unconstrained"],
                                    # q, k blocks of one matrix on different ranks
                                    ["hetero-qk"],
                                    # switches at step 4 (rank 0 decides, every rank regroups)
                                    ["auto", "--auto-logit-max", "1e-3"]], ids=lambda a: a[0])
def test_two_ranks_match_one_rank_with_accumulation(assign, tmp_path):
    data_dir = make_shards(str(tmp_path / "data"))
    two, s2 = launch(2, tmp_path / "two", data_dir, "--assign", *assign, "--grad-accum", "1")
    one, s1 = launch(1, tmp_path / "one", data_dir, "--assign", *assign, "--grad-accum", "2")
    # the same decisions (their reasons quote rank 0's first val batch, which differs)
    assert [(s["step"], s["layer"]) for s in s2.get("auto_switches", [])] == \
        [(s["step"], s["layer"]) for s in s1.get("auto_switches", [])]
    if assign[0] == "auto":
        assert [(s["step"], s["layer"]) for s in s2["auto_switches"]] == [(4, 0), (4, 1)]
    losses2 = [r["train_loss"] for r in two if "train_loss" in r]
    losses1 = [r["train_loss"] for r in one if "train_loss" in r]
    assert len(losses1) == len(losses2) == 8
    for a, b in zip(losses1, losses2):
        assert abs(a - b) <= 1e-4 * abs(a), (losses1, losses2)
    val2 = [r["val_loss"] for r in two if "val_loss" in r]
    val1 = [r["val_loss"] for r in one if "val_loss" in r]
    for a, b in zip(val1, val2):
        assert abs(a - b) <= 1e-4 * abs(a)
    assert s2["world_size"] == 2 and s1["world_size"] == 1
    assert s2["replica_max_abs_diff"] == 0.0
    assert all(r["replica_max_abs_diff"] == 0.0 for r in two if "val_loss" in r)
    assert s2["tokens"] == s1["tokens"]
    assert all(v <= 1e-4 for v in s2["max_manifold_violation"].values())
