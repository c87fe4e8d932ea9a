"""Statistics of a learning-rate x seed sweep (bash run.sh sweep): is the ordering of the assignments real?

    python -m tools.sweep_report runs/sweep-20250101-120000
    python -m tools.sweep_report runs/sweep-20250101-120000 --out elsewhere
    python -m tools.sweep_report runs/long-1000 --at-step 200 --out runs/long-1000/at-200

By default each run counts by its final val loss; --at-step N compares the val loss of the evaluation
at step N instead (runs that reached it, not diverged by then), e.g. how an ordering evolves over a
long run. The files are then named sweep-at-N.md / .png.

RUNS_DIR is searched for run folders (what train_gpt2.py writes; run.sh sweep puts them in
<spec>/lr<lr>/seed<seed>). Each run is keyed by its config.json: the assignment (with its attention
stabilizers, as in tools/report.py), muon_lr and seed. Writes sweep.md (and prints it) and sweep.png:

- the grid: per assignment and Muon lr, the final val loss mean ± sd (n) over the runs that
  completed; runs that diverged (also those that diverged and went on, --on-diverge continue)
  or did not finish are counted beside it, never averaged in;
- each assignment at its best lr: the lowest mean among the lrs where every run completed;
- pairwise Welch t-tests of the assignments at their best lrs: difference of means, t, the
  Welch–Satterthwaite df, the two-sided p-value and a 95% confidence interval (tools/stats.py);
- the same pairs paired by seed (runs of one seed share initialisation and data order): the
  paired t-test of the per-seed differences over the seeds both completed.
"""
import argparse
import math
import os
import statistics

from tools.report import find_runs
from tools.stats import Paired, Welch
from errors import UserError, run_cli

LEVEL = 0.95  # of the confidence intervals


def final(run):
    """(outcome, value) of a run by its final val loss: completed (a value to average), diverged, or
    unfinished (interrupted, killed, failed; value NaN)."""
    if run.diverged_step is not None:
        return "diverged", math.nan
    value = run.final_val()
    return ("completed" if math.isfinite(value) else "unfinished"), value


def at_step(step):
    """A measure like `final`, by the val loss of the evaluation at `step`: completed if the run was
    evaluated there and had not diverged by then."""
    def measure(run):
        if run.diverged_step is not None and run.diverged_step <= step:
            return "diverged", math.nan
        values = [row["val_loss"] for row in run.evals if row["step"] == step]
        return ("completed", values[-1]) if values else ("unfinished", math.nan)
    return measure


class Cell:
    """The runs of one assignment at one Muon lr."""

    def __init__(self, runs, measure=final):
        self.runs = runs
        measured = [(r, *measure(r)) for r in runs]
        done = [(r, value) for r, outcome, value in measured if outcome == "completed"]
        self.values = [value for _, value in done]
        self.by_seed = {r.config.get("seed"): value for r, value in done}
        self.diverged = sum(outcome == "diverged" for _, outcome, _ in measured)
        self.unfinished = sum(outcome == "unfinished" for _, outcome, _ in measured)
        self.seeds = sorted(r.config.get("seed") for r in runs)

    @property
    def n(self):
        return len(self.values)

    @property
    def all_completed(self):
        return self.n > 0 and self.n == len(self.runs)

    @property
    def mean(self):
        return statistics.fmean(self.values) if self.values else math.nan

    @property
    def sd(self):
        return statistics.stdev(self.values) if self.n > 1 else math.nan

    def summary(self):
        """"5.1234 ± 0.0123 (n=3)", with what did not complete: "; 1 of 3 diverged"."""
        if not self.values:
            text = "–"
        elif self.n == 1:
            text = f"{self.mean:.4f} (n=1)"
        else:
            text = f"{self.mean:.4f} ± {self.sd:.4f} (n={self.n})"
        total = len(self.runs)
        for count, what in ((self.diverged, "diverged"), (self.unfinished, "unfinished")):
            if count:
                text += f"; {count} of {total} {what}"
        return text


def lr_key(run):
    lr = run.config.get("muon_lr")
    if lr is None:
        raise UserError(f"{run.path}/config.json has no muon_lr: not a run of train_gpt2.py?")
    return lr


def grid(runs, measure=final):
    """{assignment: {muon lr: Cell}}: assignments in the order they first started, lrs ascending."""
    groups = {}
    for r in runs:
        groups.setdefault(r.assign, {}).setdefault(lr_key(r), []).append(r)
    return {a: {lr: Cell(by_lr[lr], measure) for lr in sorted(by_lr)} for a, by_lr in groups.items()}


def best_lr(cells):
    """The lr of the lowest mean among the lrs where every run completed, or None if there is none."""
    eligible = [lr for lr, cell in cells.items() if cell.all_completed]
    return min(eligible, key=lambda lr: cells[lr].mean) if eligible else None


def grid_table(table):
    lrs = sorted({lr for cells in table.values() for lr in cells})
    lines = ["| assignment | " + " | ".join(f"Muon lr {lr:g}" for lr in lrs) + " |", "|---" * (len(lrs) + 1) + "|"]
    for assign, cells in table.items():
        lines.append(f"| `{assign}` | " + " | ".join(cells[lr].summary() if lr in cells else "" for lr in lrs)
                     + " |")
    return "\n".join(lines)


def best_table(table, best, label="final val loss"):
    lines = [f"| assignment | best Muon lr | {label}: mean ± sd | n | seeds |", "|---|---|---|---|---|"]
    for assign, cells in table.items():
        lr = best[assign]
        if lr is None:
            lines.append(f"| `{assign}` | none: no lr where every run completed | | | |")
            continue
        cell = cells[lr]
        sd = f"{cell.sd:.4f}" if cell.n > 1 else "n/a"
        lines.append(f"| `{assign}` | {lr:g} | {cell.mean:.4f} ± {sd} | {cell.n} | "
                     + ", ".join(str(s) for s in cell.seeds) + " |")
    return "\n".join(lines)


def pairs(table, best):
    """(a, b) for every pair of assignments with a best lr, a before b."""
    ranked = [a for a in table if best[a] is not None]
    return [(a, b) for i, a in enumerate(ranked) for b in ranked[i + 1:]]


def paired_by_seed(cell_a, cell_b):
    """(seeds, Paired test) over the seeds both cells completed."""
    seeds = sorted(set(cell_a.by_seed) & set(cell_b.by_seed))
    return seeds, Paired([cell_a.by_seed[s] for s in seeds], [cell_b.by_seed[s] for s in seeds], LEVEL)


def test_cells(test, diff):
    """The table cells of a test: A − B, CI, t, df, p (or the reason there is none)."""
    if test.problem:
        return f"{diff:+.4f} | {test.problem} | | | "
    return (f"{test.diff:+.4f} | [{test.low:+.4f}, {test.high:+.4f}] | {test.t:.2f} | {test.df:.1f} | "
            f"{p_text(test.p)}")


def pair_table(table, best):
    lines = ["| A | B | A − B | 95% CI of A − B | t | df | p (two-sided) |", "|---|---|---|---|---|---|---|"]
    for a, b in pairs(table, best):
        cell_a, cell_b = table[a][best[a]], table[b][best[b]]
        welch = Welch(cell_a.values, cell_b.values, LEVEL)
        lines.append(f"| `{a}` (lr {best[a]:g}) | `{b}` (lr {best[b]:g}) | "
                     + test_cells(welch, cell_a.mean - cell_b.mean) + " |")
    return "\n".join(lines)


def paired_table(table, best):
    lines = ["| A | B | seeds | mean of A − B | 95% CI | t | df | p (two-sided) |",
             "|---|---|---|---|---|---|---|---|"]
    for a, b in pairs(table, best):
        seeds, test = paired_by_seed(table[a][best[a]], table[b][best[b]])
        if not seeds:
            lines.append(f"| `{a}` | `{b}` | none in common | | | | | |")
            continue
        diff = statistics.fmean(table[a][best[a]].by_seed[s] - table[b][best[b]].by_seed[s] for s in seeds)
        lines.append(f"| `{a}` (lr {best[a]:g}) | `{b}` (lr {best[b]:g}) | {', '.join(map(str, seeds))} | "
                     + test_cells(test, diff) + " |")
    return "\n".join(lines)


def p_text(p):
    return f"{p:.2g}" if p < 0.001 else f"{p:.3f}"


def notes(table, best):
    ns = sorted({table[a][best[a]].n for a in table if best[a] is not None})
    lrs = {lr for cells in table.values() for lr in cells}
    if not ns:
        n_text = "no assignment has a best lr"
    else:
        n_text = f"n = {ns[0]}" if len(ns) == 1 else f"n = {ns[0]} to {ns[-1]}"
        n_text += " run(s) (seeds) per assignment at its best lr"
    return [
        f"{n_text}, picked among {len(lrs)} Muon lr(s).",
        "",
        "Selection: each assignment's best lr is picked on the same runs that are then compared, so every "
        "mean at its best lr is biased low (in that assignment's favour), more so the more lrs there are "
        "and the noisier the runs; the p-values and intervals do not account for this. To confirm an "
        "ordering, rerun the best lrs on fresh seeds (bash run.sh assign SPEC... --muon-lr LR --seeds "
        "\"...\") and compare those.",
        "",
        "Welch's test treats the two groups as independent with unequal variances. Runs with the same "
        "seed share the initialisation seed and data order across assignments, so the paired test "
        "compares them seed by seed, which removes what the seed alone moves; it is tighter when that "
        "part is large, and it assumes the per-seed differences are roughly normal. With few seeds a "
        "p-value is a rough guide, not a verdict. A run that diverged "
        "or did not finish is counted in its cell, not averaged in; a cell with any such run is not "
        "eligible as a best lr.",
    ]


def label_of(step):
    return "final val loss" if step is None else f"val loss at step {step}"


def measure_of(step):
    return final if step is None else at_step(step)


def markdown(runs, figure_name, step=None):
    table = grid(runs, measure_of(step))
    best = {a: best_lr(cells) for a, cells in table.items()}
    what = ("Final val loss (the last evaluation of a completed run)" if step is None else
            f"Val loss at step {step} (the evaluation there; 'completed': runs evaluated at step {step} that had "
            "not diverged by then)")
    out = ["# Sweep report" + ("" if step is None else f" at step {step}"), "",
           f"{len(runs)} run(s). {what} per assignment and "
           "Muon lr: mean ± sd (n completed); runs that diverged or did not finish are counted, not averaged.",
           "", grid_table(table), "",
           "Each assignment at its best Muon lr (lowest mean among the lrs where every run completed):", "",
           best_table(table, best, label_of(step)), "",
           f"Pairwise at the best lrs: Welch's t-test, two-sided, and the {LEVEL:.0%} confidence interval of "
           "the difference of means (negative: A has the lower loss):", ""]
    if sum(b is not None for b in best.values()) > 1:
        out += [pair_table(table, best), "",
                "Paired by seed at the same best lrs (the seeds both completed): the paired t-test of the "
                "per-seed differences:", "", paired_table(table, best)]
    else:
        out += ["(fewer than two assignments with a best lr: nothing to compare)"]
    out += [""] + notes(table, best) + ["", f"![{label_of(step)} against Muon lr]({figure_name})", ""]
    return "\n".join(out)


def figure(runs, path, step=None):
    """Left: final val loss (or at `step`) against Muon lr per assignment (left out when the grid has
    one lr). Right: each assignment at its best lr, mean ± sd with every seed's run as a dot."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = grid(runs, measure_of(step))
    best = {a: best_lr(cells) for a, cells in table.items()}
    lrs = sorted({lr for cells in table.values() for lr in cells})
    panels = 2 if len(lrs) > 1 else 1
    fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 5.5), constrained_layout=True, squeeze=False)
    if panels == 2:
        lr_panel(axes[0][0], table, lrs, label_of(step))
    best_panel(axes[0][-1], table, best, label_of(step))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def lr_panel(ax, table, lrs, label):
    import matplotlib

    for i, (assign, cells) in enumerate(table.items()):
        color = f"C{i % 10}"
        done = {lr: c for lr, c in cells.items() if c.values}
        done_lrs = sorted(done)
        ax.errorbar(done_lrs, [done[lr].mean for lr in done_lrs],
                    yerr=[done[lr].sd if done[lr].n > 1 else 0.0 for lr in done_lrs],
                    fmt="o-", color=color, capsize=4, label=assign)
        for lr in done_lrs:  # each completed run, faintly
            ax.plot([lr] * done[lr].n, done[lr].values, ".", color=color, alpha=0.35)
        for lr, c in cells.items():  # runs that did not complete: a mark at the bottom edge
            if c.diverged or c.unfinished:
                ax.annotate(f"{c.diverged + c.unfinished}✗", (lr, 0), xycoords=("data", "axes fraction"),
                            color=color, ha="center", va="bottom", fontsize=8)
    ax.set_xscale("log")
    ax.set_xticks(lrs, [f"{lr:g}" for lr in lrs])  # the grid's lrs as plain numbers
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.set(xlabel="Muon lr", ylabel=f"{label} (mean ± sd over seeds)",
           title=f"{label} against Muon lr (✗: runs that diverged or did not finish)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def best_panel(ax, table, best, label):
    """Assignments with a best lr, lowest mean first."""
    ranked = sorted((a for a in table if best[a] is not None), key=lambda a: table[a][best[a]].mean)
    colors = {a: f"C{i % 10}" for i, a in enumerate(table)}  # the same colour as in the lr panel
    for x, assign in enumerate(ranked):
        cell = table[assign][best[assign]]
        ax.errorbar([x], [cell.mean], yerr=[cell.sd if cell.n > 1 else 0.0], fmt="s", color=colors[assign],
                    capsize=6, markersize=7)
        ax.plot([x] * cell.n, cell.values, "o", color=colors[assign], alpha=0.4, markersize=4)
    ax.set_xticks(range(len(ranked)), [f"{a}\n(lr {best[a]:g}, n={table[a][best[a]].n})" for a in ranked],
                  rotation=30, ha="right", fontsize=8)
    ax.set(ylabel=label, title="each assignment at its best lr: mean ± sd, dots: seeds")
    ax.grid(alpha=0.3, axis="y")


def write_sweep_report(runs_dir, out_dir=None, step=None):
    """Writes sweep.md and sweep.png (sweep-at-STEP.* with a step) into out_dir (default runs_dir);
    returns (the markdown, the path of the .md)."""
    runs = find_runs([runs_dir])
    out_dir = out_dir or runs_dir
    os.makedirs(out_dir, exist_ok=True)
    stem = "sweep" if step is None else f"sweep-at-{step}"
    text = markdown(runs, stem + ".png", step)
    with open(os.path.join(out_dir, stem + ".md"), "w") as f:
        f.write(text)
    figure(runs, os.path.join(out_dir, stem + ".png"), step)
    return text, os.path.join(out_dir, stem + ".md")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs_dir", metavar="RUNS_DIR",
                   help="the sweep's folder: searched for run folders (config.json, metrics.jsonl, summary.json)")
    p.add_argument("--out", default=None, metavar="DIR", help="where sweep.md and sweep.png go (default: RUNS_DIR)")
    p.add_argument("--at-step", type=int, default=None, metavar="N",
                   help="compare the val loss of the evaluation at step N instead of the final one "
                        "(writes sweep-at-N.md / .png)")
    args = p.parse_args(argv)
    if args.at_step is not None and args.at_step < 1:
        raise UserError(f"--at-step must be a step >= 1, got {args.at_step}")
    text, md = write_sweep_report(args.runs_dir, args.out, args.at_step)
    print(text)
    print(f"wrote {md} and {md[:-3]}.png")


if __name__ == "__main__":
    run_cli(main)
