"""HSDP (--fsdp --fsdp-shard-ranks 2 on 4 gloo ranks: 2 replicas x 2 shards): the replicas stay
bitwise equal (training/fsdp.check_replicas at every eval and checkpoint), the run trains as one
process does, and a parameter perturbed on one replica stops every rank at the next check with
one error naming it."""
import json
import os
import subprocess
import sys

from synthetic import TINY_MODEL, make_shards

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# rank 3 (replica 1, shard 1) changes one bit's worth of one weight before the eval of step 4
PERTURBING = '''
import os, sys, torch
import train_gpt2
original = train_gpt2.evaluate_and_log
def perturbed(run, step):
    if step + 1 == 4 and os.environ["RANK"] == "3":
        weight = run.model.blocks[0].mlp.c_fc.weight.to_local()
        with torch.no_grad():
            weight.view(-1)[0] = torch.nextafter(weight.view(-1)[0], torch.tensor(1.0))
    return original(run, step)
if os.environ.get("PERTURB"):
    train_gpt2.evaluate_and_log = perturbed
from errors import run_cli
try:
    run_cli(train_gpt2.main, sys.argv[1:])
except SystemExit as stop:  # each rank records how it ended
    open(os.path.join(os.environ["EXIT_DIR"], "rank" + os.environ.get("RANK", "0")), "w").write(str(stop.code))
    raise
'''

FLAGS = [*TINY_MODEL, "--n-layer", "2", "--batch-size", "2", "--max-steps", "6", "--eval-every", "2",
         "--eval-tokens", "512", "--warmup-steps", "1", "--ckpt-every", "3"]


def launch(tmp_path, name, data, nproc, *extra, perturb=False):
    out = tmp_path / name
    exits = tmp_path / f"{name}-exits"
    exits.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, "EXIT_DIR": str(exits)}
    if perturb:
        env["PERTURB"] = "1"
    script = tmp_path / "perturbing.py"
    script.write_text(PERTURBING)
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
                if nproc > 1 else [sys.executable])
    return subprocess.run([*launcher, str(script), "--data-dir", data, "--out-dir", str(out), *FLAGS, *extra],
                          capture_output=True, text=True, timeout=300, env=env, cwd=ROOT), out


def losses(out):
    return [row["train_loss"] for row in map(json.loads, open(out / "metrics.jsonl")) if "train_loss" in row]


def test_hsdp_replicas_stay_bitwise_equal_train_as_one_process_and_a_drift_stops_every_rank(tmp_path):
    data = make_shards(str(tmp_path / "data"))
    hsdp, hsdp_out = launch(tmp_path, "hsdp", data, 4, "--fsdp", "--fsdp-shard-ranks", "2")
    assert hsdp.returncode == 0, hsdp.stdout[-2000:] + hsdp.stderr[-3000:]  # 3 evals, 2 checkpoints checked
    one, one_out = launch(tmp_path, "one", data, 1)
    assert one.returncode == 0, one.stderr[-3000:]
    assert max(abs(a - b) for a, b in zip(losses(hsdp_out), losses(one_out))) < 1e-4
    drift, _ = launch(tmp_path, "drift", data, 4, "--fsdp", "--fsdp-shard-ranks", "2", perturb=True)
    assert drift.returncode != 0
    # every rank stopped on the error itself (status 2; none killed or hung); rank 0 names the parameter
    assert [open(tmp_path / "drift-exits" / f"rank{r}").read() for r in range(4)] == ["2"] * 4, drift.stderr[-3000:]
    assert "error: HSDP replicas drifted apart: 1 parameter(s) no longer bitwise equal across the replica groups " \
           "(blocks.0.mlp.c_fc.weight)" in drift.stderr, drift.stderr[-3000:]
