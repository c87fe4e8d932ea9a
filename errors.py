"""The exception types a user is shown as one line, and the CLI boundary that reports them.

Library code raises UserError with a message a user can act on (exit status 2), and WriteError
when the machine cannot store what the run writes: a full disk, a quota, an I/O error, a
lost mount (exit status 5). `run_cli` turns either into a single `error: ...` line on stderr,
with no traceback.
"""
import errno
import os
import shutil
import sys


class UserError(Exception):
    pass


class WriteError(Exception):
    """Writing a run's files failed; the message names the path, the cause and the free space."""


EXIT_USER_ERROR = 2
EXIT_WRITE_FAILED = 5


def free_space(path):
    """'N.N GiB free on <mount>' for the folder of `path`, or why that is unknown."""
    folder = os.path.dirname(os.path.abspath(path))
    while folder and not os.path.exists(folder):
        folder = os.path.dirname(folder)
    try:
        return f"{shutil.disk_usage(folder).free / 2**30:.1f} GiB free in {folder}"
    except OSError as err:
        return f"free space of {folder} unknown ({err.strerror})"


def write_error(path, err):
    """A WriteError for an OSError `err` raised while writing `path`."""
    cause = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is exceeded",
             errno.EIO: "an I/O error", errno.EROFS: "the filesystem is read-only",
             errno.ESTALE: "a stale network file handle (the mount was lost?)"}.get(err.errno)
    detail = err.strerror or str(err)
    return WriteError(f"cannot write {path}: {cause or detail} ({detail}); {free_space(path)}")


def run_cli(main, argv=None):
    try:
        return main(argv)
    except (UserError, WriteError) as err:
        # under torchrun every rank meets the same mistake: one report is enough
        if isinstance(err, WriteError) or os.environ.get("RANK", "0") == "0":
            print(f"error: {err}", file=sys.stderr, flush=True)
        sys.exit(EXIT_WRITE_FAILED if isinstance(err, WriteError) else EXIT_USER_ERROR)
