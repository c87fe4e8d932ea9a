"""Table and figure of an ablation: one row and one curve per training run.

    python -m tools.report runs/quick-20250101-120000          # a folder of run folders
    python -m tools.report runs/a/hetero runs/b/hetero --out cmp  # any run folders

A run folder is what train_gpt2.py writes (config.json, metrics.jsonl, summary.json); a folder
without metrics.jsonl is searched below for run folders (e.g. run.sh's <spec>/seed<S>). Runs are
listed in the order they started. Writes report.md and report.png to --out (default: the one folder given),
and prints the table.

Columns: final val loss (or how the run ended), steps, tokens, median tokens/s, optimizer share
of step time (sum of opt_ms / sum of step_ms), and over all of the run's evaluations the largest
attention logit (any layer) and the largest singular value of an attention (c_attn, its q and k
blocks, attn.c_proj) and of an MLP (c_fc, mlp.c_proj) matrix. Runs whose wall-clock times
overlapped (run.sh --jobs N, or runs started by hand) shared the machine: the report names them
and marks their tokens/s, which are then not speeds to compare.
"""
import argparse
import json
import math
import os
import statistics

from errors import UserError, run_cli

COLUMNS = ("assignment", "final val loss", "steps", "tokens", "tokens/s", "optimizer share",
           "max attn logit", "max σ attention", "max σ MLP")


class Run:
    """One run folder, read."""

    def __init__(self, path):
        self.path = path
        self.config = read_json(os.path.join(path, "config.json")) or {}
        self.summary = read_json(os.path.join(path, "summary.json"))
        self.train, self.evals, self.events = [], [], []  # events: e.g. --assign auto's switches
        with open(os.path.join(path, "metrics.jsonl")) as f:
            for line in f:
                if line.strip():
                    row = json.loads(line)
                    kind = self.events if "event" in row else self.evals if "val_loss" in row else self.train
                    kind.append(row)
        self.label = self.config.get("assign", os.path.basename(os.path.normpath(path))) + stabilizers(self.config)
        self.assign = self.label  # the label may gain the folder name; this stays the assignment

    @property
    def started(self):
        """When the trainer wrote config.json, at the run's start (seconds since the epoch)."""
        config = os.path.join(self.path, "config.json")
        return os.path.getmtime(config) if os.path.exists(config) else math.inf

    @property
    def ended(self):
        """When the run last wrote metrics.jsonl or summary.json (its end, or its latest step)."""
        return max(os.path.getmtime(p) for p in (os.path.join(self.path, "metrics.jsonl"),
                                                 os.path.join(self.path, "summary.json")) if os.path.exists(p))

    @property
    def steps(self):
        if self.summary:
            return self.summary["steps"]
        return self.train[-1]["step"] if self.train else 0

    @property
    def diverged_step(self):
        record = (self.summary or {}).get("diverged")
        return record["step"] if record else None

    def outcome(self):
        """Final val loss, or how the run ended."""
        if self.summary is None:
            return f"no summary.json (running or killed) at step {self.steps}"
        status, val = self.summary["status"], self.summary.get("final_val_loss")
        if status == "diverged":
            return f"diverged at step {self.diverged_step}"
        text = f"{val:.4f}" if val is not None else "no eval"
        if status == "interrupted":
            return f"interrupted at step {self.steps} ({text})"
        if self.diverged_step is not None:
            text = f"{text} (diverged at step {self.diverged_step}, continued)"
        switches = self.summary.get("auto_switches")
        if switches:
            text += " (auto: " + ", ".join(f"layer {s['layer']} at step {s['step']}" for s in switches) + ")"
        return text

    def final_val(self):
        """The final val loss of a completed run, else NaN."""
        if not self.summary or self.summary["status"] != "completed" or self.summary.get("final_val_loss") is None:
            return math.nan
        return self.summary["final_val_loss"]

    def last_eval(self, key):
        """The max over layers of row[key] at the last evaluation (NaN if none)."""
        _, values = self.over_evals(key)
        return values[-1] if values else math.nan

    def tokens(self):
        if self.summary:
            return self.summary["tokens"]
        return self.steps * self.config.get("tokens_per_step", 0)

    def median_tokens_per_s(self):
        return statistics.median(r["tokens_per_s"] for r in self.train) if self.train else math.nan

    def optimizer_share(self):
        total = sum(r["step_ms"] for r in self.train)
        return sum(r["opt_ms"] for r in self.train) / total if total else math.nan

    def over_evals(self, key, select=lambda name: True):
        """Per eval: the max of row[key] over the layers or matrices `select` keeps (NaN if none)."""
        steps, values = [], []
        for row in self.evals:
            if key not in row:
                continue
            field = row[key]
            items = field.items() if isinstance(field, dict) else enumerate(field)
            kept = [v for name, v in items if select(str(name))]
            steps.append(row["step"])
            values.append(max(kept, key=nan_last) if kept else math.nan)
        return steps, values

    def run_max(self, key, select=lambda name: True):
        _, values = self.over_evals(key, select)
        return max(values, key=nan_last) if values else math.nan


def stabilizers(config):
    """" +qk-norm +qk-clip 100 +softcap 50" for the attention stabilizers a run used ("" for none):
    runs of one assignment with and without them are different rows."""
    parts = [" +qk-norm"] if config.get("qk_norm") else []
    parts += [f" +qk-clip {config['qk_clip']:g}"] if config.get("qk_clip") else []
    parts += [f" +softcap {config['attn_softcap']:g}"] if config.get("attn_softcap") else []
    return "".join(parts)


def nan_last(value):
    """Sort key under which NaN/inf (a blown-up run) counts as the largest value."""
    return math.inf if not math.isfinite(value) else value


def is_attention(name):
    return ".attn." in name


def is_mlp(name):
    return ".mlp." in name


def read_json(path):
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def run_folders(path):
    """The run folders at or below `path` (a folder with metrics.jsonl is not searched further)."""
    found = []
    for folder, subfolders, files in os.walk(path):
        subfolders.sort()
        if "metrics.jsonl" in files:
            found.append(folder)
            subfolders.clear()
    return found


def find_runs(paths):
    runs = []
    for path in paths:
        if not os.path.isdir(path):
            raise UserError(f"{path} is not a folder")
        found = run_folders(path)
        if not found:
            raise UserError(f"{path} holds no run: neither metrics.jsonl nor a subfolder with one")
        runs += [Run(p) for p in found]
    runs.sort(key=lambda r: r.started)
    name_folders(runs)
    return runs


def name_folders(runs):
    """The same assignment from several folders: say which, by the parent folder's name (s1/hetero),
    else the folder's own (hetero/seed1), else both: the first that tells them apart."""
    groups = {}
    for r in runs:
        groups.setdefault(r.label, []).append(r)
    namings = (lambda p: os.path.basename(os.path.dirname(p)), os.path.basename,
               lambda p: os.path.join(os.path.basename(os.path.dirname(p)), os.path.basename(p)))
    for label, group in groups.items():
        if len(group) < 2:
            continue
        for naming in namings:
            names = [naming(os.path.abspath(r.path)) for r in group]
            if len(set(names)) == len(names):
                break
        for r, name in zip(group, names):
            r.label = f"{label} ({name})"


def shared_machine(runs):
    """{run: the other runs whose wall-clock time overlapped its own}, times from the run folders'
    files (Run.started to Run.ended). A folder copied without its file times loses them."""
    return {r: [o for o in runs if o is not r and o.started < r.ended and r.started < o.ended] for r in runs}


def number(value, fmt):
    return format(value, fmt) if math.isfinite(value) else "n/a" if math.isnan(value) else str(value)


def table(runs):
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    shared = shared_machine(runs)
    for r in runs:
        cells = [f"`{r.label}`", r.outcome(), str(r.steps), f"{r.tokens():,}",
                 number(r.median_tokens_per_s(), ",.0f") + (" (shared)" if shared[r] else ""),
                 number(100 * r.optimizer_share(), ".0f") + "%",
                 number(r.run_max("attn_logit_max"), ".2f"),
                 number(r.run_max("sigma_max", is_attention), ".3f"),
                 number(r.run_max("sigma_max", is_mlp), ".3f")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


SEED_COLUMNS = ("assignment", "runs", "final val loss: mean ± sd", "min – max", "diverged",
                "max attn logit (median)", "final softmax max prob (median)")


def seed_table(runs):
    """One row per assignment over its runs (seeds), in first-seen order; None if none repeats."""
    by_assign = {}
    for r in runs:
        by_assign.setdefault(r.assign, []).append(r)
    if all(len(group) == 1 for group in by_assign.values()):
        return None
    lines = ["| " + " | ".join(SEED_COLUMNS) + " |", "|" + "---|" * len(SEED_COLUMNS)]
    for assign, group in by_assign.items():
        finals = [v for v in (r.final_val() for r in group) if math.isfinite(v)]
        mean = statistics.mean(finals) if finals else math.nan
        sd = statistics.stdev(finals) if len(finals) > 1 else math.nan
        spread = f"{min(finals):.4f} – {max(finals):.4f}" if finals else "n/a"
        diverged = sum(1 for r in group if r.diverged_step is not None)
        cells = [f"`{assign}`", str(len(group)), f"{number(mean, '.4f')} ± {number(sd, '.4f')}", spread,
                 f"{diverged}/{len(group)}",
                 number(statistics.median(r.run_max("attn_logit_max") for r in group), ".1f"),
                 number(statistics.median(r.last_eval("softmax_max_prob") for r in group), ".2f")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def diagnostics_cost(runs):
    """Median over all evaluations of diagnostics_ms / eval_ms, and the median diagnostics_ms."""
    rows = [e for r in runs for e in r.evals if e.get("eval_ms")]
    if not rows:
        return None
    return (statistics.median(e["diagnostics_ms"] / e["eval_ms"] for e in rows),
            statistics.median(e["diagnostics_ms"] for e in rows))


def markdown(runs, figure_name):
    seeds = seed_table(runs)
    out = ["# Ablation report", ""]
    if seeds:
        out += ["Over seeds (runs of the same assignment):", "", seeds, "", "Each run:", ""]
    out += [table(runs), "",
           "Runs: " + ", ".join(f"`{r.path}`" for r in runs) + ".", "",
           "Final val loss: the last evaluation of a completed run. Max attention logit and max σ: over "
           "all evaluations and layers (σ attention includes the q and k blocks of the fused QKV). "
           "tokens/s: median over steps; optimizer share: optimizer time / step time."]
    shared = {r: others for r, others in shared_machine(runs).items() if others}
    if shared:
        out += ["", "These runs shared the machine (their wall-clock times overlapped, from config.json's "
                    "write to the last of metrics.jsonl / summary.json): their tokens/s, marked (shared), were "
                    "measured on cores the others used too, so they are not speeds to compare.", ""]
        out += [f"- `{r.label}` with " + ", ".join(f"`{o.label}`" for o in others) for r, others in shared.items()]
    cost = diagnostics_cost(runs)
    if cost:
        out += ["", f"Diagnostics cost per evaluation: median {cost[1]:.1f} ms, {100 * cost[0]:.1f}% of the "
                   "validation-loss pass."]
    out += ["", f"![curves]({figure_name})", ""]
    return "\n".join(out)


MARKERS = "osD^vP*Xph"


def figure(runs, path):
    import matplotlib.pyplot as plt

    fig = draw(runs)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def draw(runs):
    """The report's figure: val loss (with an inset of its last third), max attention logit, max
    singular values and softmax saturation against steps, one color and marker per assignment."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(13, 9), constrained_layout=True)
    loss_ax, logit_ax, sigma_ax, prob_ax = axes.flat
    # keep the loss scale readable when a run blows up: up to just above the highest first eval
    finite = [e["val_loss"] for r in runs for e in r.evals if math.isfinite(e["val_loss"])]
    firsts = [r.evals[0]["val_loss"] for r in runs if r.evals and math.isfinite(r.evals[0]["val_loss"])]
    top = 1.05 * max(firsts) if firsts else None
    style = {}  # one color and marker per assignment: its seeds share them
    for r in runs:
        style.setdefault(r.assign, {"color": f"C{len(style) % 10}", "marker": MARKERS[len(style) % len(MARKERS)]})
    # curves that lie on one another (every sigma of a Stiefel matrix is 1) are drawn side by side:
    # the sigma points of run k's attention (part 0) and MLP (part 1) move by a small fraction of
    # the spacing between evaluations
    steps = sorted({e["step"] for r in runs for e in r.evals})
    spacing = min((b - a for a, b in zip(steps, steps[1:])), default=1)
    slots = 2 * len(runs)
    dodge = {(r, part): 0.5 * spacing * ((2 * k + part + 0.5) / slots - 0.5)
             for k, r in enumerate(runs) for part in (0, 1)}
    labelled = set()
    for r in runs:
        look = dict(ms=4, **style[r.assign])
        if r.diverged_step:
            label = f"{r.label} (diverged at step {r.diverged_step})"
        elif r.assign in labelled:
            label = None
        else:
            label = r.assign
        labelled.add(r.assign)
        loss_ax.plot([e["step"] for e in r.evals], [e["val_loss"] for e in r.evals], "-", label=label, **look)
        logit_ax.plot(*r.over_evals("attn_logit_max"), "-", **look)
        for part, (select, line, fill) in enumerate(((is_attention, "-", look["color"]), (is_mlp, "--", "white"))):
            x, y = r.over_evals("sigma_max", select)
            sigma_ax.plot([s + dodge[r, part] for s in x], y, line, mfc=fill, **look)
        prob_ax.plot(*r.over_evals("softmax_max_prob"), "-", **look)
        if r.diverged_step:
            for ax in axes.flat:
                ax.axvline(r.diverged_step, color=look["color"], ls=":", lw=1.5)
            if top is not None:
                loss_ax.plot([r.diverged_step], [top], "x", color=look["color"], ms=10, mew=2, clip_on=False)
    if top is not None:
        loss_ax.set_ylim(min(finite) - 0.05 * (top - min(finite)), top)
    loss_ax.set(title="validation loss (x and dotted line: divergence)", xlabel="step", ylabel="val loss")
    loss_zoom(loss_ax, runs, style)
    logit_ax.set(title="attention logit: max |q.k|/sqrt(d_head) over layers", xlabel="step")
    sigma_ax.set(title="largest singular value: attention (solid), MLP (dashed, open markers)", xlabel="step")
    prob_ax.set(title="softmax saturation: mean max probability (max over layers)", xlabel="step")
    fit_scale(logit_ax, [v for r in runs for v in r.over_evals("attn_logit_max")[1]])
    fit_scale(sigma_ax, [v for r in runs for select in (is_attention, is_mlp)
                         for v in r.over_evals("sigma_max", select)[1]])
    fit_limits(prob_ax, [v for r in runs for v in r.over_evals("softmax_max_prob")[1]], 0, 1)
    on_one = [f"{r.label} {part}" for r in runs for part, select in (("attn", is_attention), ("MLP", is_mlp))
              if r.over_evals("sigma_max", select)[1]
              and all(abs(v - 1) < 1e-3 for v in r.over_evals("sigma_max", select)[1])]
    if on_one:
        sigma_ax.text(0.01, 0.99, "at σ = 1 throughout (drawn side by side): " + ", ".join(on_one),
                      transform=sigma_ax.transAxes, va="top", fontsize=7, wrap=True)
    loss_ax.legend(fontsize=8, loc="lower left")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    return fig


def loss_zoom(loss_ax, runs, style):
    """An inset of the last third of the evaluations with its own y-limits, so that the final
    spread between runs (often a few hundredths of a nat under a range of several nats) shows."""
    last = max((e["step"] for r in runs for e in r.evals), default=0)
    start = last * 2 / 3
    window = {r: [e for e in r.evals if e["step"] >= start and math.isfinite(e["val_loss"])]
              for r in runs if not r.diverged_step}
    values = [e["val_loss"] for rows in window.values() for e in rows]
    if len(values) < 2 or max(values) == min(values):
        return
    inset = loss_ax.inset_axes([0.45, 0.45, 0.53, 0.5])
    for r, rows in window.items():
        inset.plot([e["step"] for e in rows], [e["val_loss"] for e in rows], "-", ms=4, **style[r.assign])
        if rows:  # the final value, written at the curve's end
            inset.annotate(f"{rows[-1]['val_loss']:.3f}", (rows[-1]["step"], rows[-1]["val_loss"]),
                           xytext=(4, 0), textcoords="offset points", va="center", fontsize=7,
                           color=style[r.assign]["color"])
    fit_limits(inset, values)
    inset.set_xlim(start - 0.02 * last, last * 1.08)  # room for the final values' labels
    inset.set_title(f"last third (steps {start:.0f}-{last})", fontsize=8)
    inset.tick_params(labelsize=7)
    inset.grid(alpha=0.3)


def fit_limits(ax, values, lowest=-math.inf, highest=math.inf):
    """y-limits around the finite values, 8% of their range (at least 0.01) beyond each end."""
    values = [v for v in values if math.isfinite(v)]
    if not values:
        return
    pad = max(0.08 * (max(values) - min(values)), 0.01)
    ax.set_ylim(max(lowest, min(values) - pad), min(highest, max(values) + pad))


def fit_scale(ax, values):
    """A log axis with ticks at 1, 2 and 5 times the powers of ten where the values span more than a
    decade (a blown-up run), else a linear axis with its usual ticks."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    values = [v for v in values if math.isfinite(v) and v > 0]
    if values and max(values) / min(values) > 10:
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1, 2, 5)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
    else:
        fit_limits(ax, values)


def write_report(paths, out_dir=None):
    runs = find_runs(paths)
    if out_dir is None:
        if len(paths) != 1:
            raise UserError("several folders given: say where the report goes with --out")
        out_dir = paths[0]
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "report.md"), "w") as f:
        f.write(markdown(runs, "report.png"))
    figure(runs, os.path.join(out_dir, "report.png"))
    return runs, out_dir


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("paths", nargs="+", metavar="FOLDER", help="run folders, or folders of run folders")
    p.add_argument("--out", default=None, help="where report.md and report.png go (default: the one FOLDER)")
    args = p.parse_args(argv)
    runs, out_dir = write_report(args.paths, args.out)
    print(seed_table(runs) or table(runs))
    print(f"wrote {os.path.join(out_dir, 'report.md')} and {os.path.join(out_dir, 'report.png')}")


if __name__ == "__main__":
    run_cli(main)
