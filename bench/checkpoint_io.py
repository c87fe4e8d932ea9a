"""What verified checkpoints cost: write and load with the SHA-256 manifest against plain torch.save/load.

    python -m bench.checkpoint_io [--mb 512] [--repeat 3] [--dir /tmp]

Writes a payload of --mb MB of fp32 tensors (GPT-2 small's model + AdamW + Muon state is about
1.5 GB) to --dir, interleaving the two ways --repeat times, and prints medians: save_atomic
(hashed while written, fsynced, manifest) against torch.save to a path + fsync, and
load_checkpoint (hash check, then torch.load) against torch.load alone, as MB/s and ratios.
The page cache is warm for the loads: the hash reads what torch.load then reads again.
"""
import argparse
import os
import statistics
import time

import torch

from training.checkpoints import file_sha256, load_checkpoint, remove_checkpoint, save_atomic


def timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=512, help="payload size in MB")
    ap.add_argument("--repeat", type=int, default=3, help="interleaved rounds; medians are printed")
    ap.add_argument("--dir", default="/tmp", help="where the files go (the disk being measured)")
    args = ap.parse_args(argv)
    n = args.mb * 2**20 // 4 // 16
    payload = {"format": "manifold-muon-ckpt-1", "tensors": [torch.randn(n) for _ in range(16)]}
    verified, plain = os.path.join(args.dir, "ckpt_99999999.pt"), os.path.join(args.dir, "plain_bench.pt")

    def plain_save():
        torch.save(payload, plain)
        with open(plain, "rb+") as f:
            os.fsync(f.fileno())

    times = {k: [] for k in ("save_atomic", "torch.save", "load_checkpoint", "torch.load", "sha256")}
    for _ in range(args.repeat):
        times["save_atomic"].append(timed(lambda: save_atomic(payload, verified)))
        times["torch.save"].append(timed(plain_save))
        times["load_checkpoint"].append(timed(lambda: load_checkpoint(verified)))
        times["torch.load"].append(timed(lambda: torch.load(plain, weights_only=True)))
        times["sha256"].append(timed(lambda: file_sha256(verified)))
    size_mb = os.path.getsize(verified) / 2**20
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{size_mb:.0f} MB payload in {args.dir}, medians of {args.repeat}:")
    for k, t in med.items():
        print(f"  {k:16s} {t * 1000:8.0f} ms  {size_mb / t:8.0f} MB/s")
    print(f"  save ratio (verified / plain) {med['save_atomic'] / med['torch.save']:.2f}x; "
          f"load ratio {med['load_checkpoint'] / med['torch.load']:.2f}x")
    remove_checkpoint(verified)
    os.remove(plain)


if __name__ == "__main__":
    main()
