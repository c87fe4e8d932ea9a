"""Two gloo ranks on one machine, as a cluster would fail them: a rank killed mid-run under
torchrun --max-restarts (the job restarts itself with the same command line and ends as if
uninterrupted), and a write error on rank 0 (every rank stops at once with rank 0's message).

The kill is injected by the trainer's test-only hooks, read from the environment and absent from
--help: MMUON_FAULT_STEP=N and MMUON_FAULT_RANK=r make rank r SIGKILL itself right after step N,
and MMUON_FAULT_IN_CKPT=N makes rank 0 SIGKILL itself partway through writing checkpoint N
(64 KiB of it flushed to its file), in torchrun's first attempt only (TORCHELASTIC_RESTART_COUNT 0).
Killed: rank 1 after a step, and rank 0 (which holds the run's lock and writes the metrics and the
checkpoints) inside a checkpoint write. The write error is real: the checkpoint's temporary file
is a link to /dev/full, whose writes fail with ENOSPC.
"""
import json
import os
import random
import socket
import subprocess
import sys
import time

import pytest
import torch

from synthetic import make_shards
from test_reliability import ENV, RUN, TRAIN, has_checkpoint, resumed_steps, rows, train_losses

TWO_RANKS = ["--batch-size", "4"]  # 2 ranks x 4 sequences = the total batch of 8, no accumulation
SEED = 39  # chooses the step and the rank that die


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return make_shards(str(tmp_path_factory.mktemp("data")))


def torchrun(data_dir, out_dir, *extra, restarts=0, env=ENV):
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           f"--max-restarts={restarts}", TRAIN, "--data-dir", data_dir, "--out-dir", str(out_dir),
                           *RUN, *TWO_RANKS, *extra], capture_output=True, text=True, timeout=300, env=env)


def final_weights(out_dir):
    return torch.load(os.path.join(out_dir, "ckpt_00000030.pt"), weights_only=True)["model"]


@pytest.fixture(scope="module")
def straight(data_dir, tmp_path_factory):
    """The uninterrupted two-rank run every faulted one must end as, bit for bit."""
    out = tmp_path_factory.mktemp("straight")
    result = torchrun(data_dir, out)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def faulted_run(data_dir, out_dir, **fault):
    """The command line a launcher repeats (--resume auto from the first start on) under torchrun
    --max-restarts 1, with `fault` (environment variables) injected in its first attempt."""
    return torchrun(data_dir, out_dir, "--resume", "auto", "--log-every", "1", restarts=1, env={**ENV, **fault})


def assert_ends_as_straight(faulted, out_dir, straight, last_logged, checkpoint):
    """The first attempt started afresh and logged steps up to `last_logged` at least; the
    second resumed from ckpt `checkpoint` and trained only the steps after it (the first
    attempt's rows past that checkpoint dropped); losses, val losses and final weights are the
    straight run's, bitwise."""
    assert faulted.returncode == 0, faulted.stdout[-3000:] + faulted.stderr[-3000:]
    assert faulted.stdout.count("resuming from ") == 1, faulted.stdout
    first, second = faulted.stdout.split("resuming from ")
    assert "starting afresh" in first and f"step {last_logged:6d}/30" in first, faulted.stdout
    assert resumed_steps(subprocess.CompletedProcess([], 0, "resuming from " + second)) == \
        (checkpoint, list(range(checkpoint + 1, 31))), faulted.stdout
    assert f"resuming from {out_dir / f'ckpt_{checkpoint:08d}.pt'} at step {checkpoint}" in faulted.stdout
    assert train_losses(out_dir) == train_losses(straight)  # each step once, same bits
    val = [(r["step"], r["val_loss"]) for r in rows(out_dir) if "val_loss" in r]
    assert val == [(r["step"], r["val_loss"]) for r in rows(straight) if "val_loss" in r]
    ours, theirs = final_weights(out_dir), final_weights(straight)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert json.load(open(out_dir / "summary.json"))["status"] == "completed"


def test_a_rank_killed_mid_run_is_restarted_by_torchrun_and_ends_as_if_uninterrupted(data_dir, straight, tmp_path):
    choose = random.Random(SEED)
    fault_step, fault_rank = choose.randint(5, 27), choose.randrange(2)  # step 11, rank 1
    faulted = faulted_run(data_dir, tmp_path, MMUON_FAULT_STEP=str(fault_step), MMUON_FAULT_RANK=str(fault_rank))
    # resumed from the last checkpoint before the kill (every 4 steps)
    assert_ends_as_straight(faulted, tmp_path, straight, fault_step - 1, 4 * ((fault_step - 1) // 4))


def test_rank_0_killed_inside_a_checkpoint_write_leaves_no_partial_checkpoint(data_dir, straight, tmp_path):
    """Killed with 64 KiB of checkpoint 12 written: the atomic write leaves them in
    ckpt_00000012.pt.tmp, never under the checkpoint's name, so the restart removes that file and
    resumes from checkpoint 8 without meeting a partial checkpoint (no "skipping" line). Rank 0 dies
    mid-run as well: holding run.lock, with rows past the last checkpoint (steps 9-12) in
    metrics.jsonl, which the restart drops."""
    faulted = faulted_run(data_dir, tmp_path, MMUON_FAULT_IN_CKPT="12")
    assert "removed 1 temporary file(s) of an unfinished write: ckpt_00000012.pt.tmp" in faulted.stdout, \
        faulted.stdout
    assert "skipping" not in faulted.stdout, faulted.stdout
    assert f"step {13:6d}/30" not in faulted.stdout.split("resuming from ")[0]  # it died in the write
    assert_ends_as_straight(faulted, tmp_path, straight, 12, 8)
    assert not list(tmp_path.glob("*.tmp"))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_two_ranks(data_dir, out_dir, *extra):
    """Both ranks started by hand (torchrun's environment), so that each one's status, stderr and
    exit time are its own."""
    port = free_port()
    return [subprocess.Popen([sys.executable, TRAIN, "--data-dir", data_dir, "--out-dir", str(out_dir), *RUN,
                              *TWO_RANKS, *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**ENV, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2",
                                  "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
            for r in range(2)]


def after_first_checkpoint(ranks, out_dir, fault):
    """Once the run has written ckpt 4, call `fault`; returns each rank's (status, last stderr line,
    seconds from the fault to its exit)."""
    try:
        deadline = time.time() + 120
        while not has_checkpoint(4)(out_dir):
            assert all(p.poll() is None for p in ranks) and time.time() < deadline
            time.sleep(0.05)
        t0 = time.time()
        fault()
        exits = [None, None]
        while None in exits:
            for r, p in enumerate(ranks):
                if exits[r] is None and p.poll() is not None:
                    exits[r] = time.time() - t0
            assert time.time() < t0 + 120, "a rank did not stop"
            time.sleep(0.02)
        errors = [err.strip().splitlines()[-1] if err.strip() else "" for _, err in (p.communicate() for p in ranks)]
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
    return [(p.returncode, line, seconds) for p, line, seconds in zip(ranks, errors, exits)]


def test_a_write_error_on_rank_0_stops_every_rank_with_its_message(data_dir, tmp_path):
    """After the first checkpoint every later checkpoint's temporary file is made a link to
    /dev/full: rank 0's next checkpoint fails with ENOSPC."""
    def disk_full():
        for step in range(8, 401, 4):
            try:
                os.symlink("/dev/full", tmp_path / f"ckpt_{step:08d}.pt.tmp")
            except FileExistsError:  # being written now: the next one fails
                pass

    (status0, error0, exit0), (status1, error1, exit1) = after_first_checkpoint(
        start_two_ranks(data_dir, tmp_path, "--max-steps", "400"), tmp_path, disk_full)
    assert (status0, status1) == (5, 5), (error0, error1)
    assert error0.startswith("error: cannot write ") and "the disk is full" in error0, error0
    assert error1 == error0  # rank 1 reports rank 0's error, not a broken connection
    assert abs(exit1 - exit0) < 10  # at the same step, not after a timeout
    summary = json.load(open(tmp_path / "summary.json"))
    assert summary["status"] == "write_failed" and f"ckpt_{summary['steps']:08d}.pt" in error0


@pytest.mark.parametrize("sharding", [[], ["--fsdp"]], ids=["ddp", "fsdp"])
def test_a_bad_shard_read_by_rank_1_alone_stops_every_rank_with_its_error(tmp_path, sharding):
    """A token out of the vocabulary in the one window that rank 1 reads first at step 6 (a shard
    of other data): rank 1 alone meets it, and both ranks stop at that step with status 2 and
    rank 1's error: line (printed once, by rank 0, as every user error under torchrun)."""
    import train_gpt2
    from data.shards import HEADER_BYTES

    data = make_shards(str(tmp_path / "data"))
    stream = train_gpt2.TokenStream(train_gpt2.find_shards(data, "train"), 64)
    batches = train_gpt2.TrainBatches(stream, 32, 4, 1, 1337, rank=1, world_size=2)  # RUN's seed, TWO_RANKS
    window = batches._window(5 * 2 * 4 + 1 * 4)  # step index 5, micro-step 0, rank 1: its first sequence
    position = window * 32 + 1  # in this window only (neighbours share its first and last token)
    shard = int((stream.offsets <= position).sum()) - 1
    with open(stream.paths[shard], "r+b") as f:
        f.seek(HEADER_BYTES + 2 * (position - int(stream.offsets[shard])))
        f.write((60000).to_bytes(2, "little"))
    ranks = start_two_ranks(data, tmp_path / "run", "--max-steps", "10", *sharding)
    try:
        outputs = [p.communicate(timeout=120) for p in ranks]
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
    errors = [err.strip().splitlines()[-1] if err.strip() else "" for _, err in outputs]
    assert [p.returncode for p in ranks] == [2, 2], errors
    assert errors[0].startswith("error: token id 60000 >= --vocab-size 64 in ") and errors[0].endswith(
        "the shards do not match this model (on rank 1)"), errors[0]
    assert not errors[1].startswith("error: ") and "Error" not in errors[1], errors[1]  # no traceback of its own
    steps = [json.loads(line)["step"] for line in open(tmp_path / "run" / "metrics.jsonl") if "train_loss" in line]
    assert steps == [1, 2, 3, 4, 5]  # stopped in step 6, before its row
