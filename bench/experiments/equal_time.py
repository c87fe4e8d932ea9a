"""Steps for a scheme at the same estimated GPU time as a base scheme's run (issue 60's
"decide by training at equal estimated GPU time", as issue 49 did).

A step costs forward+backward plus the optimizer: with r the cost model's ratio of the optimizer
step to forward+backward (`bench.cost_model --fake`, GPT-2 small, hetero, one H200, ESTIMATE),
a run of N steps of the base scheme takes N (1 + r_base) time units, so the scheme gets

    steps = round(N (1 + r_base) / (1 + r_scheme)).

    python -m bench.experiments.equal_time --steps 300 --base online --scheme admm          # -> 267
    python -m bench.experiments.equal_time --steps 300 --base online --scheme admm --world-size 8

A scheme with options is written as in scheme_compare.sh: `online:dual_step=0.1,sharpen=off`.
The ratios are estimates counted on the CPU, not GPU measurements.
"""
import argparse
import contextlib
import io
import json
import os
import sys
import tempfile

from errors import UserError, run_cli


def solver_opts(scheme):
    """--solver-opt arguments of a scheme_compare.sh scheme: `name[:key=value,...]`."""
    name, _, extra = scheme.partition(":")
    opts = [f"scheme={name}"] + [kv for kv in extra.split(",") if kv]
    return [arg for kv in opts for arg in ("--solver-opt", kv)]


def estimated_ratio(scheme, world_size=1, model_args=()):
    """The cost model's ESTIMATE of the optimizer step over forward+backward for `scheme`."""
    from bench import cost_model
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "cost.json")
        argv = ["--fake", "--world-size", str(world_size), "--out", out, *solver_opts(scheme), *model_args]
        with contextlib.redirect_stdout(io.StringIO()):
            rc = cost_model.main(argv)
        if rc:
            raise UserError(f"the cost model failed for scheme {scheme!r} (exit {rc})")
        with open(out) as f:
            return json.load(f)["world_size"][str(world_size)]["ratio_estimate"]


def equal_time_steps(steps, base_ratio, ratio):
    """Steps of a scheme whose step costs (1 + ratio) that fit in `steps` steps of (1 + base_ratio)."""
    if steps < 1 or base_ratio < 0 or ratio < 0:
        raise UserError(f"steps must be >= 1 and ratios >= 0 (got {steps}, {base_ratio}, {ratio})")
    return max(1, round(steps * (1.0 + base_ratio) / (1.0 + ratio)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, required=True, help="the base scheme's steps")
    ap.add_argument("--base", default="online", help="the scheme whose run sets the time (default online)")
    ap.add_argument("--scheme", required=True, help="the scheme to fit in that time")
    ap.add_argument("--world-size", type=int, default=1, help="ranks the estimate is for (default 1; the slowest rank)")
    ap.add_argument("--verbose", action="store_true", help="print both ratios to stderr")
    args = ap.parse_args(argv)
    base = estimated_ratio(args.base, args.world_size)
    ratio = base if args.scheme == args.base else estimated_ratio(args.scheme, args.world_size)
    steps = equal_time_steps(args.steps, base, ratio)
    if args.verbose:
        print(f"{args.base}: ratio {base:.4f}; {args.scheme}: ratio {ratio:.4f}; "
              f"{args.steps} -> {steps} steps (ESTIMATE, {args.world_size} rank(s))", file=sys.stderr)
    print(steps)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
