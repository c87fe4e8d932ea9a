"""Checkpoint files: atomic, self-verifying writes, rotation, and finding the newest one that loads.

A checkpoint is one torch.save file `ckpt_<step>.pt` in the run folder, `step` being the
number of optimizer steps done (the next step to run), and beside it `ckpt_<step>.pt.sha256`,
its SHA-256 in `sha256sum` format (so `sha256sum -c ckpt_<step>.pt.sha256` checks it by hand).
Write order, each step fsynced: the payload to `ckpt_<step>.pt.tmp` (hashed as it is written),
the manifest (atomically), then the rename of the payload. A crash leaves the old set of files
or the new one, never a half-written checkpoint under a real name, and never a checkpoint
without its manifest; a manifest without its checkpoint is harmless and removed by rotation.

Two checks run on every load (`load_checkpoint`), before anything is unpickled:
- the file itself: torch.save writes a zip archive whose every record (the pickle, each tensor's
  bytes) carries a CRC-32 of its data in the zip's directory. torch.load does not check them;
  `verify_records` reads every record and does, so a checkpoint copied alone to another machine
  still proves its bytes. save_atomic always writes the CRCs (torch.serialization can be told not to).
- the manifest, when it is beside the file: the SHA-256 of every byte, zip headers included.
Bytes that changed after the write (bit rot, a bad copy, a disk that lies) make a checkpoint
"corrupt" like a truncated one: `load_newest` skips it, and a checkpoint named by the user is an
error. Only tensors and plain Python values are stored, so loading uses torch.load(weights_only=True).
What the two checks cost is in docs/checkpoints.md ("Never losing a run").

Disk use of rotation: `keep` checkpoints plus the one being written, (keep + 1) x its size at
the peak. A write that fails (full disk, quota, I/O error) removes its temporary file, leaves the
previous checkpoints as they were and raises WriteError.

What a checkpoint of train_gpt2.py holds (`checkpoint_payload`): the step, the model's state
dict, both optimizers' states, the losses so far, the training flags and the RNG states;
train_gpt2.py adds the train shards' fingerprint and, when they run, --assign auto's switches
and QK-Clip's state. `restore` loads it into a freshly built model and optimizers.
"""
import glob
import hashlib
import io
import os
import re
import zipfile
from dataclasses import fields

import torch

from errors import UserError, write_error
from manifolds.plan import SolverOptions

NAME = re.compile(r"ckpt_(\d{8})\.pt$")
FORMAT = "manifold-muon-ckpt-1"  # the payload's "format": a checkpoint of this trainer
MANIFEST = ".sha256"
HASH_CHUNK = 1 << 22  # 4 MiB reads when verifying


def checkpoint_path(out_dir, step, prefix="ckpt"):
    return os.path.join(out_dir, f"{prefix}_{step:08d}.pt")


def fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class HashingWriter(io.RawIOBase):
    """A write-only file that updates a SHA-256 with every byte it passes to `file`.

    `after_write`, None but in tests, is called with the writer after each write: the trainer's
    fault injection (train_gpt2.injected_write_fault) kills the process there, mid-checkpoint."""

    after_write = None

    def __init__(self, file):
        self.file, self.sha256, self.size = file, hashlib.sha256(), 0
        self.error = None  # the OSError a write met: torch.save's zip writer masks it with its own

    def writable(self):
        return True

    def write(self, data):
        try:
            written = self.file.write(data)
        except OSError as err:
            self.error = err
            raise
        self.sha256.update(memoryview(data)[:written])
        self.size += written
        if self.after_write is not None:
            self.after_write(self)
        return written


def write_text_atomic(path, text):
    """`text` into `path` by a fsynced temporary file and a rename."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_with_crc32(payload, file):
    """torch.save with every zip record's CRC-32 computed, whatever torch.serialization's setting:
    the CRCs are what lets a checkpoint be checked without its manifest."""
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(True)
    try:
        torch.save(payload, file)
    finally:
        torch.serialization.set_crc32_options(before)


def save_atomic(payload, path, after_write=None):
    """torch.save `payload` to `path` with its manifest; returns the SHA-256 (hex).
    On an OSError (ENOSPC, EDQUOT, EIO, ...) the temporary files go and WriteError is raised.
    `after_write`: tests only (HashingWriter)."""
    tmp, writer = f"{path}.tmp", None
    try:
        with open(tmp, "wb") as f:
            writer = HashingWriter(f)
            writer.after_write = after_write
            save_with_crc32(payload, writer)
            f.flush()
            os.fsync(f.fileno())
        digest = writer.sha256.hexdigest()
        write_text_atomic(path + MANIFEST, f"{digest}  {os.path.basename(path)}\n")
        os.replace(tmp, path)
        fsync_dir(os.path.dirname(os.path.abspath(path)))
    except (OSError, RuntimeError) as err:
        # a failed write inside torch.save surfaces as "RuntimeError: [enforce fail at
        # inline_container.cc] unexpected pos": the writer kept the OSError behind it
        cause = err if isinstance(err, OSError) else (writer.error if writer is not None else None)
        if cause is None:
            raise
        for leftover in (tmp, path + MANIFEST + ".tmp"):
            try:
                os.remove(leftover)
            except OSError:
                pass
        raise write_error(path, cause) from None
    return digest


def list_checkpoints(out_dir):
    """Rotating checkpoints in out_dir, newest first."""
    found = [(int(m.group(1)), p) for p in glob.glob(os.path.join(out_dir, "ckpt_*.pt"))
             if (m := NAME.search(os.path.basename(p)))]
    return [p for _, p in sorted(found, reverse=True)]


def remove_checkpoint(path):
    for name in (path, path + MANIFEST):
        if os.path.exists(name):
            os.remove(name)


def save_checkpoint(payload, out_dir, step, keep, after_write=None):
    """Write ckpt_<step>.pt atomically, then delete all but the newest `keep` (and stray manifests).
    `after_write`: tests only (HashingWriter)."""
    path = checkpoint_path(out_dir, step)
    save_atomic(payload, path, after_write)
    for old in list_checkpoints(out_dir)[keep:]:
        remove_checkpoint(old)
    for manifest in glob.glob(os.path.join(out_dir, "ckpt_*.pt" + MANIFEST)):
        if not os.path.exists(manifest[:-len(MANIFEST)]):
            os.remove(manifest)
    return path


def file_sha256(path):
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            sha.update(chunk)
    return sha.hexdigest()


def verify(path):
    """Raise ValueError unless `path` hashes to its manifest's SHA-256; True if it was checked,
    False for a checkpoint without a manifest (written before manifests existed)."""
    manifest = path + MANIFEST
    if not os.path.exists(manifest):
        return False
    try:
        want = open(manifest).read().split()[0]
        got = file_sha256(path)
    except (OSError, IndexError) as err:
        raise ValueError(f"{path}: cannot check its checksum ({err})") from None
    if got != want:
        raise ValueError(f"{path}: corrupt checkpoint (SHA-256 {got[:16]}... differs from {want[:16]}... "
                         f"in {os.path.basename(manifest)}: its bytes changed after it was written)")
    return True


def verify_records(path):
    """Raise ValueError unless every record of the zip archive `path` (torch.save's format) matches
    the CRC-32 its zip directory holds for it. Needs nothing beside the file."""
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()  # reads every record, compares its CRC-32; the first bad one's name
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as err:
        raise ValueError(f"{path}: unreadable checkpoint (not a complete torch.save zip archive: {err})") from None
    if bad is not None:
        raise ValueError(f"{path}: corrupt checkpoint (its record {bad} fails its CRC-32: "
                         "its bytes changed after it was written)")


def load_checkpoint(path):
    """The payload of a checkpoint file: its records checked against their CRC-32s, the file against
    its manifest when one is beside it, then unpickled; raises ValueError (naming `path`) if it is
    corrupt, unreadable, incomplete or another program's file. Nothing is unpickled from a file that
    fails a check."""
    verify(path)
    verify_records(path)
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # bad pickle, a tensor type weights_only refuses: all mean "not ours"
        raise ValueError(f"{path}: unreadable checkpoint ({type(err).__name__}: {str(err)[:120]})") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        found = payload.get("format") if isinstance(payload, dict) else type(payload).__name__
        raise ValueError(f"{path}: not a checkpoint of this trainer (format {found!r}, expected {FORMAT!r})")
    return payload


def load_newest(out_dir, report):
    """(path, payload) of the newest checkpoint that loads; corrupt ones are reported and skipped."""
    for path in list_checkpoints(out_dir):
        try:
            return path, load_checkpoint(path)
        except ValueError as err:
            report(f"skipping {err}")
    return None, None


# ----------------------------------------------------------------------------------------
# What train_gpt2.py saves and resumes from

# What a resumed run must share with its checkpoint: the model's shapes and assignment, and the
# total batch (the data a step reads is a function of the step and the total batch). The
# micro-batch and the number of processes may change: they only change the accumulation.
RESUME_FIXED_ARGS = ("n_layer", "n_head", "n_embd", "seq_len", "vocab_size", "assign", "total_batch_size",
                     "qk_norm", "attn_softcap", "qk_clip")


def find_resume_checkpoint(args, say):
    """(path, payload) of --resume PATH, or of --resume auto: the newest checkpoint in --out-dir that
    loads (corrupt ones are reported and skipped), or (None, None) when --out-dir holds no
    checkpoint at all, so that one command line both starts a run and resumes it. Checkpoints
    of which none loads are an error, not a fresh start: that would train over them."""
    if args.resume == "auto":
        found = list_checkpoints(args.out_dir) if os.path.isdir(args.out_dir) else []
        if not found:
            say(f"--resume auto: no checkpoint in --out-dir {args.out_dir}: starting afresh")
            return None, None
        path, payload = load_newest(args.out_dir, say)
        if payload is None:
            raise UserError(f"--resume auto: none of the {len(found)} checkpoint(s) in --out-dir {args.out_dir} "
                            "loads (each is reported above); move them away to start afresh")
        return path, payload
    if os.path.isdir(args.resume):  # an --fsdp run's folder: resumed unsharded (training/sharded_checkpoints.py)
        from training.sharded_checkpoints import load_run_payload, verify_sharded
        problem = verify_sharded(args.resume)
        if problem is not None:
            raise UserError(problem)
        return args.resume, load_run_payload(args.resume)
    try:
        return args.resume, load_checkpoint(args.resume)
    except ValueError as err:
        raise UserError(str(err)) from None


def run_payload(step, losses, args):
    """What a checkpoint holds besides the model's and optimizers' tensors."""
    return {"format": FORMAT, "step": step, **losses,
            "args": {k: v for k, v in vars(args).items() if k != "assignment"},
            "rng": {"cpu": torch.get_rng_state(),
                    "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}}


def checkpoint_payload(step, model, adamw, muon_state, losses, args):
    return {**run_payload(step, losses, args), "model": model.state_dict(), "adamw": adamw.state_dict(),
            "muon": muon_state}


def solver_settings(args):
    """{solver option: value} a run's flags (a dict of them) set: --kernels, --solver-precision and
    --solver-opt, with SolverOptions' defaults for the rest."""
    given = {"backend": args.get("kernels", "auto"), "precision": args.get("solver_precision", "auto"),
             **args.get("solver_options", {})}
    return {f.name: given.get(f.name, f.default) for f in fields(SolverOptions)}


def restore(payload, model, adamw, muon, args):
    """Load a checkpoint into the model, the optimizers and the RNGs. Returns {solver option:
    (checkpoint's value, this run's)} for the solver options this run changes: they are this
    run's flags (they change cost and accuracy, not what is trained), and so is --dgram-cap."""
    check_resumable(payload, args)
    model.load_state_dict(payload["model"])
    adamw.load_state_dict(payload["adamw"])
    load_muon_state(muon, payload["muon"])
    return restore_run(payload, args)


def load_muon_state(muon, state_dict):
    """ManifoldMuon's state from a checkpoint; --dgram-cap stays this run's (load_state_dict brings
    back the checkpoint's group options)."""
    caps = [group.get("dgram_cap") for group in muon.param_groups]
    muon.load_state_dict(state_dict)
    for group, cap in zip(muon.param_groups, caps):
        group["dgram_cap"] = cap


def check_resumable(payload, args):
    """UserError unless this run may continue the checkpoint (RESUME_FIXED_ARGS)."""
    saved = payload["args"]
    fixed = RESUME_FIXED_ARGS + (("auto_base",) if args.assign.strip() == "auto" else ())
    changed = [k for k in fixed if k in saved and saved[k] != getattr(args, k)]
    if changed:
        raise UserError("cannot resume: the checkpoint was written with a different "
                        + ", ".join(f"--{k.replace('_', '-')} ({saved.get(k)} there, {getattr(args, k)} now)"
                                    for k in changed))


def restore_run(payload, args):
    """The RNGs of a checkpoint; returns {solver option: (checkpoint's value, this run's)} changed."""
    torch.set_rng_state(payload["rng"]["cpu"])
    if payload["rng"]["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(payload["rng"]["cuda"])
    before, now = solver_settings(payload["args"]), solver_settings(vars(args))
    return {k: (before[k], now[k]) for k in now if before[k] != now[k]}
