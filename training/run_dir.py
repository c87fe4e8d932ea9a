"""Guards of the run folder (--out-dir): one run at a time, no leftovers, one folder for all ranks.

- RunLock: global rank 0 holds an exclusive flock on `<out-dir>/run.lock` for the whole run, so
  a second run started into the same folder is refused instead of interleaving its checkpoints
  and logs with the first. The kernel drops the lock when its process dies (however it dies), so
  a stale lock never blocks a resume. The file says who holds it, for the error message. On
  Linux, flock on NFS is carried out as an NFS byte-range lock, so it holds across nodes too.
- remove_leftovers: `*.tmp` files are the temporaries of writes a killed process never finished
  (checkpoints, manifests, JSON); under the lock nobody else can be writing them.
- check_shared_out_dir: checkpoints are written by global rank 0 alone, so on several nodes
  --out-dir must be one shared folder. Rank 0 writes a token there and every rank reads it back.
- check_out_dir, before anything starts: a folder that holds another run is continued
  (--resume) or cleared (--overwrite, `clear_run`), never mixed with a new one. --resume auto in
  a folder without a checkpoint starts afresh there (the first start of a job that a launcher
  or scheduler restarts with the same command line).
"""
import fcntl
import glob
import os
import shutil
import socket
import time
import uuid

from errors import UserError

LOCK_NAME = "run.lock"


class RunLock:
    def __init__(self, out_dir):
        self.path = os.path.join(out_dir, LOCK_NAME)
        self.fd = None

    def acquire(self):
        """Take the lock or raise UserError naming its holder."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 512).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise UserError(f"--out-dir {os.path.dirname(self.path)} is in use by another run ({holder}); "
                            "wait for it to end or choose another --out-dir") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}, since "
                     f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode())
        self.fd = fd
        return self

    def release(self):
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


def remove_leftovers(out_dir):
    """Delete the temporary files of unfinished writes in out_dir; returns their names."""
    removed = []
    for path in sorted(glob.glob(os.path.join(out_dir, "*.tmp"))):
        if os.path.isdir(path):  # an --fsdp checkpoint folder not finished (training/sharded_checkpoints.py)
            shutil.rmtree(path)
        else:
            os.remove(path)
        removed.append(os.path.basename(path))
    return removed


def check_shared_out_dir(out_dir, rank, world_size):
    """Raise UserError on every rank unless all ranks see the file rank 0 writes into out_dir.
    A collective (torch.distributed, already initialised): every rank must call it."""
    import torch.distributed as dist

    box = [uuid.uuid4().hex if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    token_path = os.path.join(out_dir, f".shared-check-{box[0]}")
    if rank == 0:
        with open(token_path, "w") as f:
            f.write(box[0])
    dist.barrier()
    try:
        with open(token_path) as f:
            seen = f.read() == box[0]
    except OSError:
        seen = False
    views = [None] * world_size
    dist.all_gather_object(views, (seen, socket.gethostname()))
    dist.barrier()  # everyone has looked before rank 0 removes the token
    if rank == 0:
        os.remove(token_path)
    blind = [f"rank {r} on {host}" for r, (ok, host) in enumerate(views) if not ok]
    if blind:
        raise UserError(f"--out-dir {out_dir} is not shared: {', '.join(blind)} cannot see the file that rank 0 "
                        f"on {views[0][1]} wrote there. Checkpoints are written by rank 0 alone, so a resume "
                        "on other nodes needs the folder: put --out-dir on a filesystem every node mounts "
                        "(the same absolute path on each)")


RUN_FILES = ("config.json", "metrics.jsonl", "summary.json")


def check_out_dir(args):
    """Refuse to mix two runs in one folder, to resume nothing, or to write where we cannot."""
    holds_run = any(os.path.exists(os.path.join(args.out_dir, f)) for f in RUN_FILES)
    if args.resume is None and holds_run and not args.overwrite:
        raise UserError(f"--out-dir {args.out_dir} holds another run; pass --resume auto to continue it "
                        "or --overwrite to start afresh there")
    if args.resume is not None and args.overwrite:
        raise UserError("--resume and --overwrite contradict each other")
    if args.resume not in (None, "auto") and not (os.path.isfile(args.resume) or args.resume.rstrip("/").endswith(".dcp")
                                                  and os.path.isdir(args.resume)):
        raise UserError(f"--resume {args.resume}: no such checkpoint (a ckpt_<step>.pt file, or an --fsdp run's "
                        f"ckpt_<step>.dcp folder)")
    existing = args.out_dir
    while not os.path.exists(existing):
        existing = os.path.dirname(os.path.abspath(existing))
    if not os.path.isdir(existing):
        raise UserError(f"--out-dir {args.out_dir}: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"--out-dir {args.out_dir} is not writable")


def clear_run(out_dir):
    """--overwrite: delete another run's logs and checkpoints (the lock is held)."""
    for path in ([os.path.join(out_dir, f) for f in RUN_FILES] + glob.glob(os.path.join(out_dir, "*.pt"))
                 + glob.glob(os.path.join(out_dir, "*.pt.sha256"))):
        if os.path.exists(path):
            os.remove(path)
    for path in glob.glob(os.path.join(out_dir, "*.dcp")):  # --fsdp checkpoint folders
        shutil.rmtree(path, ignore_errors=True)
