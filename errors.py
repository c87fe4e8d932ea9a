"""The one exception type for user mistakes, and the CLI boundary that reports it.

Library code raises UserError with a message a user can act on; `run_cli` turns it into a
single `error: ...` line on stderr and exit status 2, with no traceback.
"""
import os
import sys


class UserError(Exception):
    pass


EXIT_USER_ERROR = 2


def run_cli(main, argv=None):
    try:
        return main(argv)
    except UserError as err:
        # under torchrun every rank meets the same mistake: one report is enough
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {err}", file=sys.stderr, flush=True)
        sys.exit(EXIT_USER_ERROR)
