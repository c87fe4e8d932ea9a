"""The progress manifest of a prepare.py run: what is done, so that a rerun finishes the rest.

`prepare_progress.json` in the output folder records the settings that determine the output,
`next_document` (the first document the checkpoint does not cover) and, per split, the complete
shards, tokens and documents written up to that point. It is replaced atomically, and only
after the shard files it describes are on disk. `"done": true` marks a finished folder.
"""
import glob
import json
import os

from errors import UserError

PROGRESS_FILE = "prepare_progress.json"
SPLITS = ("train", "val")


def progress_path(out_dir):
    return os.path.join(out_dir, PROGRESS_FILE)


def new_progress(settings):
    return {"settings": settings, "next_document": 0, "done": False,
            "splits": {split: {"shards": 0, "tokens": 0, "documents": 0} for split in SPLITS}}


def load_progress(out_dir):
    """The manifest in out_dir, or None if there is none."""
    path = progress_path(out_dir)
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as err:
        raise UserError(f"{path} is unreadable ({err}); delete the folder and prepare the data again") from None


def save_progress(out_dir, progress):
    """Atomically replace the manifest, then fsync the folder so earlier renames are durable too."""
    path = progress_path(out_dir)
    with open(f"{path}.tmp", "w", encoding="utf-8") as f:
        json.dump(progress, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(f"{path}.tmp", path)
    folder = os.open(out_dir, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def has_shards(folder):
    """Whether folder holds files the trainer would read as shards (its globs)."""
    return any(glob.glob(os.path.join(folder, f"*{split}*.bin")) for split in SPLITS)


def start_or_resume(out_dir, settings):
    """The progress to continue from: a new run's, or the matching one already in out_dir."""
    progress = load_progress(out_dir)
    if progress is None:
        if has_shards(out_dir):
            raise UserError(f"--out-dir {out_dir} already holds shards that no resumable prepare.py run "
                            f"wrote (no {PROGRESS_FILE}); choose an empty folder or delete them")
        progress = new_progress(settings)
        save_progress(out_dir, progress)
        return progress
    changed = sorted(key for key in set(settings) | set(progress["settings"])
                     if settings.get(key) != progress["settings"].get(key))
    if changed:
        raise UserError(f"--out-dir {out_dir} holds a run with different {', '.join(changed)}; rerun with "
                        "the same input and settings to finish it, or use another --out-dir")
    return progress


def require_finished(data_dir):
    """For readers of shards: refuse a folder whose prepare.py run has not finished."""
    progress = load_progress(data_dir)
    if progress is not None and not progress.get("done"):
        raise UserError(f"{data_dir} holds an unfinished data/prepare.py run ({PROGRESS_FILE}); "
                        "rerun the same prepare.py command to finish it")
