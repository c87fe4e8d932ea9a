"""Random-token shards for smoke runs where no corpus is at hand (a GPU check, say).

    python bench/make_synthetic_shards.py OUT_DIR [--tokens N]
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from data.shards import write_shard  # noqa: E402

ap = argparse.ArgumentParser(description=__doc__)
ap.add_argument("out_dir")
ap.add_argument("--tokens", type=int, default=2_000_000)
args = ap.parse_args()
os.makedirs(args.out_dir, exist_ok=True)
rng = np.random.default_rng(0)
write_shard(os.path.join(args.out_dir, "train_000000.bin"), rng.integers(0, 50257, args.tokens))
write_shard(os.path.join(args.out_dir, "val_000000.bin"), rng.integers(0, 50257, args.tokens // 10))
