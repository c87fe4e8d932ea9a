"""Small learnable token data for trainer tests (no corpus, no tokenizer), and the trainer run in
the test's own process."""
import os

import numpy as np

from data.shards import write_shard


def pattern_tokens(n, vocab, seed):
    """A noisy cycle: token t+1 = (token t + 1) mod vocab most of the time. Learnable fast."""
    rng = np.random.default_rng(seed)
    tokens = np.zeros(n, dtype=np.int64)
    jumps = rng.random(n) < 0.1
    noise = rng.integers(0, vocab, n)
    for i in range(1, n):
        tokens[i] = noise[i] if jumps[i] else (tokens[i - 1] + 1) % vocab
    return tokens


def make_shards(data_dir, train_tokens=20000, val_tokens=4000, vocab=64, train_shards=2):
    os.makedirs(data_dir, exist_ok=True)
    train = pattern_tokens(train_tokens, vocab, seed=0)
    for i, part in enumerate(np.array_split(train, train_shards)):
        write_shard(os.path.join(data_dir, f"train_{i:06d}.bin"), part)
    write_shard(os.path.join(data_dir, "val_000000.bin"), pattern_tokens(val_tokens, vocab, seed=1))
    return data_dir


TINY_MODEL = ["--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--seq-len", "32",
              "--vocab-size", "64", "--total-batch-size", "8", "--batch-size", "8", "--device", "cpu", "--wandb", "off",
              "--log-every", "1000"]


def train_in_process(data_dir, out_dir, *flags):
    """Run train_gpt2.main on TINY_MODEL in this process, on one thread (the reference solver's
    small SVDs are 10x faster on one thread than on two contending); return its train losses."""
    import json

    import torch

    import train_gpt2
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train_gpt2.main(["--data-dir", data_dir, "--out-dir", str(out_dir), *TINY_MODEL, *flags])
    finally:
        torch.set_num_threads(threads)
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [row["train_loss"] for row in map(json.loads, f) if "train_loss" in row]


def trainer_in_process(*argv):
    """`python train_gpt2.py ARGV` run in this process, as its __main__ runs it (errors.run_cli: a
    mistake is one `error:` line and exit status 2), returned as subprocess.run returns it. For runs
    that stop on a mistake before training: a subprocess spends about 2 s of CPU importing torch
    for it. (Tests that a real process prints one line and no traceback run train_gpt2.py itself:
    test_distributed, test_reliability's missing --data-dir, test_run_sh's flag mistakes.)"""
    import contextlib
    import io
    import subprocess

    import train_gpt2
    from errors import run_cli
    out, err, status = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            run_cli(train_gpt2.main, [str(arg) for arg in argv])
        except SystemExit as stop:
            status = stop.code if isinstance(stop.code, int) else 1
    return subprocess.CompletedProcess(["train_gpt2.py", *argv], status, out.getvalue(), err.getvalue())
