"""--fsdp with gradient accumulation: the gradients are reduce-scattered on every micro-step by
default (each rank keeps only its shards), on the last one with --fsdp-grad-sync last (DDP's
choice); the two train alike. The trainer runs under torchrun on 2 gloo ranks with FSDP2's
reduce-scatter counted (torch.distributed.reduce_scatter_single, which FSDP2 calls)."""
import json
import os
import subprocess
import sys

from synthetic import TINY_MODEL, make_shards

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

COUNTING = '''
import json, os, sys
import torch.distributed as dist
calls = [0]
original = dist.reduce_scatter_single
def counted(*args, **kwargs):
    calls[0] += 1
    return original(*args, **kwargs)
dist.reduce_scatter_single = counted
import train_gpt2
try:
    train_gpt2.main(sys.argv[1:])
finally:
    with open(os.path.join(os.environ["COUNT_DIR"], "rank" + os.environ["RANK"]), "w") as f:
        json.dump(calls[0], f)
'''


def run(tmp_path, name, data, *flags):
    out = tmp_path / name
    out.mkdir()
    script = tmp_path / "counting.py"
    script.write_text(COUNTING)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, "COUNT_DIR": str(out)}
    # 8 sequences per step = 2 ranks x 2 per micro-step x 2 micro-steps
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             str(script), "--data-dir", data, "--out-dir", str(out / "run"), *TINY_MODEL,
                             "--batch-size", "2", "--max-steps", "3", "--eval-every", "3", "--eval-tokens", "512",
                             "--warmup-steps", "1", "--fsdp", "--ckpt-every", "0", *flags],
                            capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    counts = [json.load(open(out / f"rank{rank}")) for rank in range(2)]
    losses = [row["train_loss"] for row in map(json.loads, open(out / "run" / "metrics.jsonl")) if "train_loss" in row]
    return counts, losses


def test_every_micro_step_reduce_scatters_by_default_and_last_only_with_the_flag(tmp_path):
    data = make_shards(str(tmp_path / "data"))
    every, every_losses = run(tmp_path, "every", data)
    last, last_losses = run(tmp_path, "last", data, "--fsdp-grad-sync", "last")
    assert last[0] == last[1] > 0  # the same on both ranks
    assert every == [2 * last[0]] * 2, (every, last)  # 2 micro-steps: twice the reduce-scatters
    assert max(abs(a - b) for a, b in zip(every_losses, last_losses)) < 1e-5  # the same sums, rounded apart
