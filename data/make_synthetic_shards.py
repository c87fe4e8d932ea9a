"""Synthetic token shards for smoke runs where no corpus is at hand (a GPU check, say).

    python -m data.make_synthetic_shards OUT_DIR [--tokens N] [--mode random|pattern]

random:  uniform GPT-2 token ids. Nothing to learn: the loss stays near ln(50257) = 10.8.
pattern: a noisy cycle over the GPT-2 vocabulary, learnable in a few hundred steps: the next
         token is the current one + 1 (mod 50257), except with probability --jump, when it is
         drawn from a Zipf law over the vocabulary (so a few ids are frequent and the unigram
         statistics are learnt first). The floor is about H(jump) + jump * H(Zipf) nats.
Writes train_000000.bin (--tokens) and val_000000.bin (a tenth of it, another seed).
"""
import argparse
import os

import numpy as np

from data.shards import write_shard

VOCAB = 50257  # GPT-2's token ids


def cycle_tokens(n, vocab, seed, jump=0.1, zipf=1.2):
    """The noisy cycle, vectorized (tests/synthetic.py's pattern_tokens loops in Python; 20M
    tokens take seconds here): between two jumps the ids count up by one from the jump's id."""
    rng = np.random.default_rng(seed)
    jumps = rng.random(n) < jump
    jumps[0] = True  # the first run starts at a drawn id too
    starts = np.flatnonzero(jumps)
    first = (rng.zipf(zipf, starts.size) - 1) % vocab  # Zipf ids 0, 1, 2, ... most frequent first
    run = np.cumsum(jumps) - 1  # which run each position is in
    offset = np.arange(n) - starts[run]
    return (first[run] + offset) % vocab


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--tokens", type=int, default=2_000_000, help="train tokens (val: a tenth)")
    ap.add_argument("--mode", choices=("random", "pattern"), default="random")
    ap.add_argument("--jump", type=float, default=0.1, help="pattern: probability of a jump per token")
    args = ap.parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    for name, n, seed in (("train", args.tokens, 0), ("val", max(args.tokens // 10, 1), 1)):
        if args.mode == "random":
            tokens = np.random.default_rng(seed).integers(0, VOCAB, n)
        else:
            tokens = cycle_tokens(n, VOCAB, seed, args.jump)
        write_shard(os.path.join(args.out_dir, f"{name}_000000.bin"), tokens)
    print(f"{args.out_dir}: {args.tokens:,} train and {max(args.tokens // 10, 1):,} val tokens ({args.mode})")


if __name__ == "__main__":
    main()
