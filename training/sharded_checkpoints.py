"""Checkpoints of --fsdp runs: one torch.distributed.checkpoint (DCP) folder per checkpoint.

    ckpt_<step>.dcp/
        __<rank>_<n>.distcp   each rank's shards of the model and both optimizers, written at once
        .metadata              DCP's index (rank 0)
        run.pt                 what is not sharded: step, losses, flags, RNG states, train shards'
                               fingerprint (training.checkpoints.checkpoint_payload without tensors)
        SHA256SUMS             every other file's SHA-256, in `sha256sum -c` format

Written atomically: into ckpt_<step>.dcp.tmp/, each rank hashing the files it wrote (no byte goes
through rank 0), then rank 0 writes run.pt and the manifest, fsyncs and renames the folder. A
crash leaves a .tmp folder (removed by the next run, as the trainer's other leftovers) and the
previous checkpoints. Rotation keeps the newest --keep-ckpts.

Verified on load before any tensor is read: rank r hashes every P-th file of the manifest and the
ranks agree on the result, so a corrupt or missing shard file makes the whole checkpoint corrupt
on every rank (one `skipping ...` line naming the file), and --resume auto goes on to the one
before it. The model and optimizer states load through get_state_dict / set_state_dict, so a
checkpoint saved on N ranks resumes on M.
"""
import glob
import hashlib
import os
import re
import shutil

import torch
import torch.distributed as dist

from errors import write_error
from training.checkpoints import FORMAT, fsync_dir

NAME = re.compile(r"ckpt_(\d{8})\.dcp$")
MANIFEST = "SHA256SUMS"
RUN_FILE = "run.pt"


def sharded_checkpoint_path(out_dir, step, prefix="ckpt"):
    return os.path.join(out_dir, f"{prefix}_{step:08d}.dcp")


def list_sharded_checkpoints(out_dir):
    """Rotating --fsdp checkpoints in out_dir, newest first."""
    found = [(int(m.group(1)), p) for p in glob.glob(os.path.join(out_dir, "ckpt_*.dcp"))
             if (m := NAME.search(os.path.basename(p))) and os.path.isdir(p)]
    return [p for _, p in sorted(found, reverse=True)]


def sha256_of(path):
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            sha.update(chunk)
    return sha.hexdigest()


def states(model, optimizers):
    from torch.distributed.checkpoint.state_dict import get_state_dict
    model_state, optim_state = get_state_dict(model, optimizers)
    return {"model": model_state, "optim": optim_state}


def save_sharded(path, model, optimizers, payload, keep=None):
    """Write a checkpoint folder (module docstring): a collective, every rank calls it. `payload`:
    rank 0's run.pt (no tensors of the model or optimizers). Returns the path; WriteError on rank 0
    when its part fails (the others raise the same at the trainer's next status exchange)."""
    import torch.distributed.checkpoint as dcp
    rank = dist.get_rank()
    tmp = path + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    dcp.save(states(model, optimizers), checkpoint_id=tmp)
    mine = {os.path.basename(f): sha256_of(f) for f in sorted(glob.glob(os.path.join(tmp, f"__{rank}_*")))}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if rank == 0:
        try:
            torch.save(payload, os.path.join(tmp, RUN_FILE))
            sums = {name: digest for part in every for name, digest in part.items()}
            for name in (".metadata", RUN_FILE):
                sums[name] = sha256_of(os.path.join(tmp, name))
            with open(os.path.join(tmp, MANIFEST), "w") as f:
                f.writelines(f"{digest}  {name}\n" for name, digest in sorted(sums.items()))
                f.flush()
                os.fsync(f.fileno())
            fsync_dir(tmp)
            shutil.rmtree(path, ignore_errors=True)  # an older run's folder of the same step
            os.replace(tmp, path)
            fsync_dir(os.path.dirname(os.path.abspath(path)))
        except OSError as err:
            shutil.rmtree(tmp, ignore_errors=True)
            raise write_error(path, err) from None
        if keep is not None:
            for old in list_sharded_checkpoints(os.path.dirname(path))[keep:]:
                shutil.rmtree(old, ignore_errors=True)
    return path


def verify_sharded(path):
    """None when every file of the folder's manifest is there with its SHA-256, else why not (a
    collective: rank r checks every P-th file; every rank gets the same answer)."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    problem = None
    manifest = os.path.join(path, MANIFEST)
    if not os.path.isfile(manifest):
        problem = f"{path}: no {MANIFEST} (an unfinished or foreign folder)"
    else:
        with open(manifest) as f:
            entries = [line.rstrip("\n").split("  ", 1) for line in f if line.strip()]
        for digest, name in entries[rank::world]:
            file = os.path.join(path, name)
            if not os.path.isfile(file):
                problem = f"{file}: missing"
                break
            if sha256_of(file) != digest:
                problem = f"{file}: its bytes changed since the checkpoint was written (SHA-256 mismatch)"
                break
    if world > 1:
        every = [None] * world
        dist.all_gather_object(every, problem)
        problem = next((p for p in every if p is not None), None)
    return problem


def load_run_payload(path):
    payload = torch.load(os.path.join(path, RUN_FILE), weights_only=True)
    if payload.get("format") != FORMAT:
        raise ValueError(f"{path}: not a checkpoint of this trainer")
    return payload


def load_sharded(path, model, optimizers):
    """Load a verified folder's model and optimizer states into the (sharded) model and optimizers."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict
    state = states(model, optimizers)
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizers, model_state_dict=state["model"], optim_state_dict=state["optim"])


def find_sharded_resume(args, say):
    """(path, payload) for --resume under --fsdp (a collective): --resume PATH, or --resume auto: the
    newest folder in --out-dir that verifies, corrupt ones reported and skipped. A one-file
    checkpoint (ckpt_<step>.pt of a run without --fsdp: --resume PATH, or --resume auto in a folder
    with no .dcp folder) is found as without --fsdp (training.checkpoints.find_resume_checkpoint):
    the trainer shards its whole state on load. (None, None) when there is no checkpoint at all."""
    from errors import UserError
    from training.checkpoints import find_resume_checkpoint
    if args.resume != "auto":
        if not os.path.isdir(args.resume):
            return find_resume_checkpoint(args, say)
        candidates = [args.resume]
    else:
        candidates = list_sharded_checkpoints(args.out_dir) if os.path.isdir(args.out_dir) else []
        if not candidates:
            return find_resume_checkpoint(args, say)
    for path in candidates:
        problem = verify_sharded(path)
        if problem is None:
            try:
                return path, load_run_payload(path)
            except (OSError, RuntimeError, ValueError) as err:
                problem = f"{path}: {err}"
        if args.resume != "auto":
            raise UserError(problem)
        say(f"skipping {problem}")
    raise UserError(f"--resume auto: none of the {len(candidates)} checkpoint(s) in --out-dir {args.out_dir} "
                    "verifies (each is reported above); move them away to start afresh")
