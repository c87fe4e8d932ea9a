"""Checkpoint files: atomic writes, rotation, and finding the newest one that loads.

A checkpoint is one torch.save file `ckpt_<step>.pt` in the run folder, `step` being the
number of optimizer steps done (the next step to run). It is written to a temporary name,
fsynced, renamed, and the folder fsynced, so a crash leaves either the old set of files or
the new one, never a half-written checkpoint under a real name. Only tensors and plain
Python values are stored, so loading uses torch.load(weights_only=True).
"""
import glob
import os
import re

import torch

NAME = re.compile(r"ckpt_(\d{8})\.pt$")


def checkpoint_path(out_dir, step, prefix="ckpt"):
    return os.path.join(out_dir, f"{prefix}_{step:08d}.pt")


def _fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_atomic(payload, path):
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        torch.save(payload, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))


def list_checkpoints(out_dir):
    """Rotating checkpoints in out_dir, newest first."""
    found = [(int(m.group(1)), p) for p in glob.glob(os.path.join(out_dir, "ckpt_*.pt"))
             if (m := NAME.search(os.path.basename(p)))]
    return [p for _, p in sorted(found, reverse=True)]


def save_checkpoint(payload, out_dir, step, keep):
    """Write ckpt_<step>.pt atomically, then delete all but the newest `keep`."""
    path = checkpoint_path(out_dir, step)
    save_atomic(payload, path)
    for old in list_checkpoints(out_dir)[keep:]:
        os.remove(old)
    return path


def load_checkpoint(path):
    """The payload of a checkpoint file; raises ValueError if it is unreadable or incomplete."""
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # truncated zip, bad pickle, wrong format: all mean "corrupt"
        raise ValueError(f"{path}: unreadable checkpoint ({type(err).__name__}: {str(err)[:120]})") from None
    if not isinstance(payload, dict) or payload.get("format") != "manifold-muon-ckpt-1":
        raise ValueError(f"{path}: not a checkpoint of this trainer")
    return payload


def load_newest(out_dir, report):
    """(path, payload) of the newest checkpoint that loads; corrupt ones are reported and skipped."""
    for path in list_checkpoints(out_dir):
        try:
            return path, load_checkpoint(path)
        except ValueError as err:
            report(f"skipping {err}")
    return None, None
