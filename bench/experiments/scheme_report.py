"""The table of bench/experiments/scheme_compare.sh: final val loss of each scheme, setting and assignment
over seeds, and the online scheme against ADMM by Welch's and the paired (by seed) t-test
(tools/stats.py, the sweep's statistics).

    python -m bench.experiments.scheme_report                       # runs/scheme-compare
    python -m bench.experiments.scheme_report --root runs/scheme-compare --a online --b admm
"""
import argparse
import glob
import json
import os
import statistics
import sys

from errors import UserError, run_cli
from tools.stats import Paired, Welch


def final_losses(root):
    """{(setting, scheme, assign): {seed: final val loss}} of the completed runs under root."""
    table = {}
    for path in glob.glob(os.path.join(root, "*", "*", "seed*", "*", "summary.json")):
        setting, scheme, seed, assign = path.split(os.sep)[-5:-1]
        with open(path) as f:
            summary = json.load(f)
        if summary.get("status") == "completed" and summary.get("final_val_loss") is not None:
            table.setdefault((setting, scheme, assign), {})[int(seed[4:])] = summary["final_val_loss"]
    return table


def p_text(test):
    return test.problem or (f"{test.p:.2g}" if test.p < 0.001 else f"{test.p:.3f}")


def report(table, a, b):
    lines = [f"| setting | assign | {a}: mean (sd), n | {b}: mean (sd), n | {a} − {b} | Welch p | paired p (seeds) |",
             "|---|---|---|---|---|---|---|"]
    keys = sorted({(setting, assign) for setting, _, assign in table})
    for setting, assign in keys:
        runs_a, runs_b = table.get((setting, a, assign), {}), table.get((setting, b, assign), {})
        cells = []
        for runs in (runs_a, runs_b):
            values = list(runs.values())
            sd = f"{statistics.stdev(values):.4f}" if len(values) > 1 else "-"
            cells.append(f"{statistics.fmean(values):.4f} ({sd}), {len(values)}" if values else "none")
        if runs_a and runs_b:
            diff = statistics.fmean(runs_a.values()) - statistics.fmean(runs_b.values())
            seeds = sorted(set(runs_a) & set(runs_b))
            welch = Welch(list(runs_a.values()), list(runs_b.values()))
            paired = Paired([runs_a[s] for s in seeds], [runs_b[s] for s in seeds])
            tests = f"{diff:+.4f} | {p_text(welch)} | {p_text(paired)} ({', '.join(map(str, seeds))})"
        else:
            tests = " | | "
        lines.append(f"| {setting} | {assign} | {cells[0]} | {cells[1]} | {tests} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", default="runs/scheme-compare", help="OUT of bench/experiments/scheme_compare.sh")
    ap.add_argument("--a", default="online", help="the scheme tested (A in A − B)")
    ap.add_argument("--b", default="admm", help="the scheme it is compared with")
    args = ap.parse_args(argv)
    table = final_losses(args.root)
    if not table:
        raise UserError(f"no completed runs under {args.root} (bash bench/experiments/scheme_compare.sh writes them)")
    print(report(table, args.a, args.b))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
