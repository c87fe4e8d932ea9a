"""run.sh sweep and --seeds, tools/sweep_report.py, and the statistics under it (tools/stats.py)."""
import json
import math
import os
import re
import subprocess
import sys

import pytest

from tools import sweep_report
from tools.stats import Paired, Welch, betainc, t_cdf, t_quantile, t_two_sided_p
from test_run_sh import TINY, data_dir, run_sh  # noqa: F401 (data_dir: the fixture)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --- the t distribution ---------------------------------------------------------------------------

@pytest.mark.parametrize("df, critical", [(2, 4.3027), (4, 2.7764), (10, 2.2281), (30, 2.0423), (1, 12.7062)])
def test_two_sided_95_critical_values_match_the_table(df, critical):
    assert round(t_quantile(0.975, df), 4) == critical
    assert round(t_quantile(0.025, df), 4) == -critical
    assert t_cdf(critical, df) == pytest.approx(0.975, abs=2e-5)


@pytest.mark.parametrize("df", [0.7, 1, 2, 5.52, 17.776, 100])
def test_t_cdf_is_a_symmetric_distribution(df):
    assert t_cdf(0.0, df) == 0.5
    for t in (0.1, 1.0, 2.5, 10.0):
        assert t_cdf(-t, df) == pytest.approx(1 - t_cdf(t, df), abs=1e-14)
        assert t_two_sided_p(t, df) == pytest.approx(2 * (1 - t_cdf(t, df)), abs=1e-12)
    for p in (0.001, 0.3, 0.9, 0.999):
        assert t_cdf(t_quantile(p, df), df) == pytest.approx(p, abs=1e-12)


def test_t_cdf_matches_the_closed_forms_of_1_and_2_degrees_of_freedom():
    for t in (-7.0, -1.0, 0.3, 2.0, 50.0):
        assert t_cdf(t, 1) == pytest.approx(0.5 + math.atan(t) / math.pi, abs=1e-13)       # Cauchy
        assert t_cdf(t, 2) == pytest.approx(0.5 + t / (2 * math.sqrt(2 + t * t)), abs=1e-13)


def test_incomplete_beta_edges_and_a_closed_form():
    assert betainc(2.0, 3.0, 0.0) == 0.0 and betainc(2.0, 3.0, 1.0) == 1.0
    # I_x(a, 1) = x^a; on both sides of the switch point (a + 1) / (a + b + 2)
    for x in (0.2, 0.9):
        assert betainc(2.5, 1.0, x) == pytest.approx(x ** 2.5, rel=1e-13)


def two_sided_p_by_integration(t, df, steps=20_000):
    """An independent reference: 1 - 2 * (Simpson's rule of the t density from 0 to |t|)."""
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    density = lambda x: math.exp(log_c - (df + 1) / 2 * math.log1p(x * x / df))  # noqa: E731
    h = abs(t) / steps
    area = density(0) + density(abs(t)) + sum((4 if i % 2 else 2) * density(i * h) for i in range(1, steps))
    return 1 - 2 * area * h / 3


# --- Welch's test ---------------------------------------------------------------------------------

def test_welch_t_and_df_of_a_hand_computed_example():
    # a: mean 2.5, variance 5/3; b: mean 6, variance 10. se^2 = 5/12 + 10/5 = 29/12;
    # df = (29/12)^2 / ((5/12)^2 / 3 + 2^2 / 4) = 2523/457
    w = Welch([1, 2, 3, 4], [2, 4, 6, 8, 10])
    assert w.diff == -3.5 and w.se == pytest.approx(math.sqrt(29 / 12), rel=1e-14)
    assert w.t == pytest.approx(-3.5 / math.sqrt(29 / 12), rel=1e-14)
    assert w.df == pytest.approx(2523 / 457, rel=1e-14)
    assert w.p == pytest.approx(two_sided_p_by_integration(w.t, 2523 / 457), abs=1e-9)
    half = t_quantile(0.975, 2523 / 457) * math.sqrt(29 / 12)
    assert (w.low, w.high) == pytest.approx((-3.5 - half, -3.5 + half), rel=1e-12)


def test_welch_p_is_two_sided_with_welch_df_not_pooled():
    # R: t.test(extra ~ group, data = sleep): t = -1.8608, df = 17.776, p-value = 0.07939,
    # 95 percent confidence interval: -3.3654832 0.2054832. Pooled (df 18) it would be p = 0.07919;
    # one-sided, 0.0397.
    g1 = [0.7, -1.6, -0.2, -1.2, -0.1, 3.4, 3.7, 0.8, 0.0, 2.0]
    g2 = [1.9, 0.8, 1.1, 0.1, -0.1, 4.4, 5.5, 1.6, 4.6, 3.4]
    w = Welch(g1, g2)
    assert round(w.t, 4) == -1.8608 and round(w.df, 3) == 17.776
    assert w.p == pytest.approx(0.07939, abs=5e-6)
    assert w.p == pytest.approx(two_sided_p_by_integration(w.t, w.df), abs=1e-9)
    for wrong in (two_sided_p_by_integration(w.t, 18), two_sided_p_by_integration(w.t, w.df) / 2):
        assert abs(w.p - wrong) > 1e-4
    assert (round(w.low, 7), round(w.high, 7)) == (-3.3654832, 0.2054832)


def test_paired_t_of_the_sleep_data():
    # R: t.test(sleep$extra[1:10], sleep$extra[11:20], paired = TRUE): t = -4.0621, df = 9,
    # p-value = 0.002833, 95 percent confidence interval: -2.4598858 -0.7001142 (Welch on the same
    # data, unpaired: p = 0.07939, above)
    g1 = [0.7, -1.6, -0.2, -1.2, -0.1, 3.4, 3.7, 0.8, 0.0, 2.0]
    g2 = [1.9, 0.8, 1.1, 0.1, -0.1, 4.4, 5.5, 1.6, 4.6, 3.4]
    t = Paired(g1, g2)
    assert round(t.t, 4) == -4.0621 and t.df == 9 and t.diff == pytest.approx(-1.58, abs=1e-12)
    assert t.p == pytest.approx(0.002833, abs=5e-7)
    assert (round(t.low, 7), round(t.high, 7)) == (-2.4598858, -0.7001142)
    # the order of the pairs does not matter; the pairing does
    assert Paired(g1[::-1], g2[::-1]).t == pytest.approx(t.t, rel=1e-12)
    assert abs(Paired(g1, g2[1:] + g2[:1]).t - t.t) > 1
    assert Paired([1.0], [2.0]).problem == "needs at least 2 pairs (n = 1)"
    assert "same amount" in Paired([1.0, 2.0], [2.0, 3.0]).problem
    with pytest.raises(ValueError):
        Paired([1.0, 2.0], [1.0])


def test_welch_needs_two_runs_each_and_some_spread():
    assert Welch([1.0], [1.0, 2.0]).problem == "needs at least 2 runs each (n = 1 and 2)"
    assert "no spread" in Welch([1.0, 1.0], [2.0, 2.0]).problem
    assert math.isnan(Welch([1.0], [2.0, 3.0]).p)


# --- the report of synthetic run folders ---------------------------------------------------------

def fake_run(folder, assign, lr, seed, final, status="completed", early=None):
    """A run folder in train_gpt2.py's format (fields as a tiny real run writes them): status
    completed, diverged (at step 3) or None (killed: no summary.json); evaluated at steps 2 and 4
    (or 3 when diverged), with val loss `early` (default `final`) at step 2 and `final` after."""
    os.makedirs(folder)
    config = {"assign": assign, "seed": seed, "device": "cpu", "n_layer": 1, "n_head": 2, "n_embd": 32,
              "seq_len": 32, "vocab_size": 64, "qk_norm": False, "qk_clip": 0.0, "attn_softcap": 0.0,
              "total_batch_size": 8, "batch_size": 4, "max_steps": 4, "lr": 0.0006, "optimizer": "muon",
              "muon_lr": lr, "eval_every": 2, "world_size": 1, "tokens_per_step": 256}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    steps = 3 if status == "diverged" else 4
    with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
        for step in range(1, steps + 1):
            f.write(json.dumps({"step": step, "train_loss": final + 0.1, "lr": 0.0006, "grad_norm": 0.6,
                                "tokens_per_s": 15000.0, "step_ms": 16.0, "opt_ms": 11.0}) + "\n")
            if step % 2 == 0 or step == steps:
                val = early if early is not None and step == 2 else final
                f.write(json.dumps({"step": step, "val_loss": val, "eval_tokens": 256, "attn_logit_max": [1.3],
                                    "softmax_max_prob": [0.18], "sigma_max": {"blocks.0.attn.c_attn.weight": 1.0},
                                    "eval_ms": 5.0, "diagnostics_ms": 1.0}) + "\n")
    if status is None:
        return
    diverged = {"step": 3, "train_loss": 2e4, "lr": 0.0006, "grad_norm": 4e4} if status == "diverged" else None
    with open(os.path.join(folder, "summary.json"), "w") as f:
        json.dump({"status": status, "steps": steps, "tokens": 256 * steps, "final_val_loss": final,
                   "final_train_loss": final + 0.1, "world_size": 1, "diverged": diverged, "wall_s": 0.1}, f, indent=2)


GRID = {  # (assignment, lr): {seed: (final val loss, status)}
    ("hetero", 0.02): {1: (4.10, "completed"), 2: (4.12, "completed"), 3: (4.14, "completed")},
    ("hetero", 0.05): {1: (4.00, "completed"), 2: (4.02, "completed"), 3: (3e4, "diverged")},
    ("all-stiefel", 0.02): {1: (4.30, "completed"), 2: (4.31, "completed"), 3: (4.32, "completed"),
                            4: (4.5, None)},
    ("all-stiefel", 0.05): {1: (4.20, "completed"), 2: (4.24, "completed"), 3: (4.22, "completed")},
    ("all-dgram", 0.05): {1: (4.50, "completed")},
}


def write_grid(root):
    for (assign, lr), seeds in GRID.items():
        for seed, (final, status) in seeds.items():
            fake_run(root / assign / f"lr{lr}" / f"seed{seed}", assign, lr, seed, final, status)


def table(text, header):
    """The rows (lists of cells) of the table whose header line starts with `header`."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    out = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        out.append([c.strip() for c in line.strip().strip("|").split("|")])
    return out


def name(cell):
    """The assignment in a cell: "`hetero` (lr 0.02)" -> "hetero"."""
    return re.match(r"`([^`]*)`", cell).group(1)


def rows(text, header):
    """{assignment: cells} of a table keyed by its first column."""
    return {name(cells[0]): cells for cells in table(text, header)}


def test_sweep_report_of_a_synthetic_grid(tmp_path):
    write_grid(tmp_path)
    text, _ = sweep_report.write_sweep_report(str(tmp_path))
    assert text == (tmp_path / "sweep.md").read_text()
    grid = rows(text, "| assignment | Muon lr 0.02")
    # the diverged run and the killed one are counted, not averaged
    assert grid["hetero"][1:] == ["4.1200 ± 0.0200 (n=3)", "4.0100 ± 0.0141 (n=2); 1 of 3 diverged"]
    assert grid["all-stiefel"][1:] == ["4.3100 ± 0.0100 (n=3); 1 of 4 unfinished", "4.2200 ± 0.0200 (n=3)"]
    assert grid["all-dgram"][1:] == ["", "4.5000 (n=1)"]
    best = rows(text, "| assignment | best Muon lr")
    # hetero's lower mean at 0.05 does not count: a run there diverged
    assert best["hetero"][1:] == ["0.02", "4.1200 ± 0.0200", "3", "1, 2, 3"]
    assert best["all-stiefel"][1:] == ["0.05", "4.2200 ± 0.0200", "3", "1, 2, 3"]
    assert best["all-dgram"][1:] == ["0.05", "4.5000 ± n/a", "1", "1"]
    pairs = {f"{name(r[0])} / {name(r[1])}": r for r in table(text, "| A | B |")}
    assert list(pairs) == ["hetero / all-stiefel", "hetero / all-dgram", "all-stiefel / all-dgram"]
    # equal sds 0.02, n = 3 each: se = 0.02 sqrt(2/3), t = -0.1 / se, df = 4 exactly
    se = 0.02 * math.sqrt(2 / 3)
    half = t_quantile(0.975, 4) * se
    assert pairs["hetero / all-stiefel"][2:] == ["-0.1000", f"[{-0.1 - half:+.4f}, {-0.1 + half:+.4f}]",
                                                 f"{-0.1 / se:.2f}", "4.0", f"{t_two_sided_p(-0.1 / se, 4):.3f}"]
    assert pairs["hetero / all-dgram"][2:4] == ["-0.3800", "needs at least 2 runs each (n = 3 and 1)"]
    # paired by seed: hetero 4.10, 4.12, 4.14 against all-stiefel 4.20, 4.24, 4.22: differences
    # -0.10, -0.12, -0.08, mean -0.1, sd 0.02, df 2
    paired = {f"{name(r[0])} / {name(r[1])}": r for r in table(text, "| A | B | seeds |")}
    se = 0.02 / math.sqrt(3)
    half = t_quantile(0.975, 2) * se
    assert paired["hetero / all-stiefel"][2:] == ["1, 2, 3", "-0.1000", f"[{-0.1 - half:+.4f}, {-0.1 + half:+.4f}]",
                                                  f"{-0.1 / se:.2f}", "2.0", f"{t_two_sided_p(-0.1 / se, 2):.3f}"]
    assert paired["hetero / all-dgram"][2:5] == ["1", "-0.4000", "needs at least 2 pairs (n = 1)"]
    assert "n = 1 to 3 run(s) (seeds) per assignment at its best lr, picked among 2 Muon lr(s)" in text
    assert "Selection:" in text and "biased" in text
    assert (tmp_path / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sweep_report_at_a_step_compares_that_evaluation(tmp_path):
    # (assignment, seed): (val loss at step 2, final, status); the order flips between step 2 and the end
    runs = {("hetero", 1): (5.0, 4.0, "completed"), ("hetero", 2): (5.2, 4.2, "completed"),
            ("all-stiefel", 1): (4.9, 4.3, "completed"), ("all-stiefel", 2): (5.1, 4.5, "completed"),
            ("all-dgram", 1): (4.8, 3e4, "diverged"), ("all-dgram", 2): (4.7, 4.6, None)}
    for (assign, seed), (early, last, status) in runs.items():
        fake_run(tmp_path / assign / "lr0.05" / f"seed{seed}", assign, 0.05, seed, last, status, early)
    best_of = lambda text: rows(text, "| assignment | best Muon lr")  # noqa: E731
    final_text, _ = sweep_report.write_sweep_report(str(tmp_path))
    assert best_of(final_text)["hetero"][2] == "4.1000 ± 0.1414"
    assert best_of(final_text)["all-stiefel"][2] == "4.4000 ± 0.1414"
    assert rows(final_text, "| assignment | Muon lr")["all-dgram"][1] == "–; 1 of 2 diverged; 1 of 2 unfinished"
    text, md = sweep_report.write_sweep_report(str(tmp_path), step=2)
    assert md == str(tmp_path / "sweep-at-2.md") and (tmp_path / "sweep-at-2.png").exists()
    assert text.startswith("# Sweep report at step 2") and "| val loss at step 2: mean ± sd |" in text
    best = best_of(text)
    assert best["hetero"][2] == "5.1000 ± 0.1414" and best["all-stiefel"][2] == "5.0000 ± 0.1414"
    # both all-dgram runs were evaluated at step 2 before the one diverged (step 3) and the other was killed
    assert best["all-dgram"][2] == "4.7500 ± 0.0707"
    # at step 4: the diverged run counts as diverged, the killed one was evaluated there
    assert rows(sweep_report.markdown(sweep_report.find_runs([str(tmp_path)]), "x.png", 4),
                "| assignment | Muon lr")["all-dgram"][1] == "4.6000 (n=1); 1 of 2 diverged"
    # step 3: no evaluation of the completed runs there
    assert rows(sweep_report.markdown(sweep_report.find_runs([str(tmp_path)]), "x.png", 3),
                "| assignment | Muon lr")["hetero"][1] == "–; 2 of 2 unfinished"
    cli = [sys.executable, "-m", "tools.sweep_report", str(tmp_path)]
    result = subprocess.run([*cli, "--at-step", "0"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 2 and result.stderr.startswith("error: --at-step") and "Traceback" not in result.stderr


def test_sweep_report_says_when_no_lr_qualifies_and_its_cli_mistakes(tmp_path):
    fake_run(tmp_path / "runs" / "hetero" / "lr0.1" / "seed1", "hetero", 0.1, 1, 3e4, "diverged")
    cli = [sys.executable, "-m", "tools.sweep_report"]
    result = subprocess.run([*cli, str(tmp_path / "runs"), "--out", str(tmp_path / "out")],
                            capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert "| `hetero` | none: no lr where every run completed |" in result.stdout
    assert "nothing to compare" in result.stdout and (tmp_path / "out" / "sweep.md").exists()
    (tmp_path / "empty").mkdir()
    for folder, message in [("empty", "holds no run"), ("missing", "is not a folder")]:
        result = subprocess.run([*cli, str(tmp_path / folder)], capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert result.returncode == 2 and result.stderr.startswith("error: ") and message in result.stderr
        assert "Traceback" not in result.stderr


# --- run.sh ---------------------------------------------------------------------------------------

def test_run_sh_sweep_end_to_end(data_dir, tmp_path):  # noqa: F811
    result = run_sh(tmp_path, "sweep", "--muon-lrs", "0.02 0.05", "--seeds", "1 2", "--jobs", "2", "hetero",
                    "--data-dir", data_dir, "--vocab-size", "64", *TINY)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    runs = tmp_path / "runs"
    for i, (seed, lr) in enumerate([(1, "0.02"), (1, "0.05"), (2, "0.02"), (2, "0.05")], 1):  # seed-major
        assert f"== [{i}/4] hetero (lr {lr}, seed {seed}): completed" in result.stdout
        config = json.load(open(runs / "hetero" / f"lr{lr}" / f"seed{seed}" / "config.json"))
        assert config["muon_lr"] == float(lr) and config["seed"] == seed and config["assign"] == "hetero"
        assert config["n_embd"] == 32 and config["run_name"] == f"hetero/lr{lr}/seed{seed}"
    text = (runs / "sweep.md").read_text()
    assert text in result.stdout
    grid = rows(text, "| assignment | Muon lr 0.02")
    assert list(grid) == ["hetero"] and all(cell.endswith("(n=2)") for cell in grid["hetero"][1:])
    assert rows(text, "| assignment | best Muon lr")["hetero"][3:] == ["2", "1, 2"]
    again = run_sh(tmp_path, "sweep", "--muon-lrs", "0.02", "--seeds", "2", "hetero", "--data-dir", data_dir,
                   "--vocab-size", "64", *TINY)
    assert again.returncode == 0 and "hetero (lr 0.02, seed 2): already completed" in again.stdout


def test_assign_with_seeds_makes_a_folder_per_seed(data_dir, tmp_path):  # noqa: F811
    result = run_sh(tmp_path, "assign", "hetero", "--seeds", "1 02", "--jobs", "1", "--data-dir", data_dir,
                    "--vocab-size", "64", *TINY)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for i, seed in enumerate([1, 2], 1):
        assert f"== [{i}/2] hetero (seed {seed}): completed" in result.stdout
        config = json.load(open(tmp_path / "runs" / "hetero" / f"seed{seed}" / "config.json"))
        assert config["seed"] == seed and config["muon_lr"] == 0.05  # quick's
    # tools/report.py finds them two levels down and groups the seeds
    text = (tmp_path / "runs" / "report.md").read_text()
    assert "| `hetero` | 2 |" in text and "`hetero (seed1)`" in text and "`hetero (seed2)`" in text


@pytest.mark.parametrize("args, message", [
    (["sweep", "hetero", "--muon-lr", "0.1"], "the sweep sets --muon-lr per run"),
    (["sweep", "--muon-lr=0.1"], "the sweep sets --muon-lr per run"),
    (["sweep", "--muon", "0.1"], "the sweep sets --muon-lr per run"),  # argparse would take the abbreviation
    (["sweep", "--seed", "3"], "--seeds sets --seed per run"),
    (["assign", "hetero", "--seeds", "1 2", "--seed", "3"], "--seeds sets --seed per run"),
    (["sweep", "--muon-lrs", "0.1 -0.2"], "--muon-lrs: -0.2 is not a positive number"),
    (["sweep", "--muon-lrs", "0"], "--muon-lrs: 0 is not a positive number"),
    (["sweep", "--muon-lrs", "1e-2 abc"], "--muon-lrs: abc is not a positive number"),
    (["sweep", "--muon-lrs", "0.1 0.1"], "--muon-lrs: 0.1 given twice"),
    (["sweep", "--seeds", "1 x"], "--seeds: x is not a seed"),
    (["sweep", "--seeds=-1"], "--seeds: -1 is not a seed"),
    (["quick", "--seeds", "1 01"], "--seeds: 1 given twice"),
    (["sweep", "--seeds", ""], "an empty list"),
    (["sweep", "--seeds"], "the list is missing"),
    (["quick", "--muon-lrs", "0.1"], "bash run.sh sweep"),
])
def test_sweep_mistakes_are_one_clean_line(args, message, tmp_path):
    result = run_sh(tmp_path, *args)
    assert result.returncode == 2 and result.stderr.startswith("error: ") and message in result.stderr
    assert not (tmp_path / "runs").exists()
