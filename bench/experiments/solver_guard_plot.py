"""Figure and table of bench/experiments/solver_guard.sh: val-loss curves of the default solver budget
against 20 iterations, per assignment and seed, and the two spreads that decide the guard.

    python -m bench.experiments.solver_guard_plot runs/solver-guard     # writes guard.md and guard.png there
"""
import argparse
import glob
import os

from tools.report import Run
from errors import UserError, run_cli

SETTINGS = ("default", "iters20")


def load(root):
    """{(setting, assign, seed folder): Run}"""
    runs = {}
    for setting in SETTINGS:
        for path in sorted(glob.glob(os.path.join(root, setting, "seed*", "*", "metrics.jsonl"))):
            run_dir = os.path.dirname(path)
            seed = os.path.basename(os.path.dirname(run_dir))
            runs[(setting, os.path.basename(run_dir), seed)] = Run(run_dir)
    if not runs:
        raise UserError(f"no runs under {root}/{{{','.join(SETTINGS)}}}/seed*/; "
                        "run bench/experiments/solver_guard.sh first")
    return runs


def table(runs):
    assigns = sorted({a for _, a, _ in runs})
    seeds = sorted({s for _, _, s in runs})
    lines = ["| assign | " + " | ".join(f"{st} ({', '.join(seeds)})" for st in SETTINGS)
             + " | max setting gap | max seed spread |", "|---" * 5 + "|"]
    for assign in assigns:
        finals = {st: [runs[(st, assign, s)].final_val() for s in seeds if (st, assign, s) in runs] for st in SETTINGS}
        gaps = [abs(runs[("default", assign, s)].final_val() - runs[("iters20", assign, s)].final_val())
                for s in seeds if ("default", assign, s) in runs and ("iters20", assign, s) in runs]
        spreads = [max(v) - min(v) for v in finals.values() if len(v) > 1]
        lines.append(f"| {assign} | " + " | ".join(", ".join(f"{v:.4f}" for v in finals[st]) for st in SETTINGS)
                     + f" | {max(gaps, default=float('nan')):.4f} | {max(spreads, default=float('nan')):.4f} |")
    return "\n".join(lines)


def plot(runs, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    assigns = sorted({a for _, a, _ in runs})
    fig, axes = plt.subplots(1, len(assigns), figsize=(5 * len(assigns), 3.6), squeeze=False)
    for ax, assign in zip(axes[0], assigns):
        for (setting, a, seed), run in sorted(runs.items()):
            if a != assign:
                continue
            steps = [r["step"] for r in run.evals]
            ax.plot(steps, [r["val_loss"] for r in run.evals], color="C0" if setting == "default" else "C3",
                    linestyle="-" if seed.endswith("1") else "--", label=f"{setting} {seed}")
        ax.set_title(assign)
        ax.set_xlabel("step")
        ax.set_ylabel("val loss")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("root", help="the OUT folder of bench/experiments/solver_guard.sh")
    args = ap.parse_args(argv)
    runs = load(args.root)
    text = table(runs)
    print(text)
    with open(os.path.join(args.root, "guard.md"), "w") as f:
        f.write(text + "\n")
    plot(runs, os.path.join(args.root, "guard.png"))


if __name__ == "__main__":
    run_cli(main)
