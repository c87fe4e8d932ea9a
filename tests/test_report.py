"""tools/report.py: the ablation table and figure from run folders."""
import json
import os
import subprocess
import sys

from tools import report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def fake_run(folder, assign, evals, summary, started, seconds=100):
    """A run folder as train_gpt2.py writes it: 10 train rows (opt_ms a quarter of step_ms), its
    files written from `started` to `started + seconds` (seconds since the epoch)."""
    os.makedirs(folder)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({"assign": assign, "tokens_per_step": 1000}, f)
    os.utime(os.path.join(folder, "config.json"), (started, started))
    with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
        for step in range(1, 11):
            f.write(json.dumps({"step": step, "train_loss": 5.0, "tokens_per_s": 1000.0 * step,
                                "step_ms": 100.0, "opt_ms": 25.0}) + "\n")
        for step, val, logit, sigma_attn, sigma_mlp in evals:
            f.write(json.dumps({
                "step": step, "val_loss": val, "attn_logit_max": [logit / 2, logit],
                "softmax_max_prob": [0.3, 0.9],
                "sigma_max": {"blocks.0.attn.c_attn.weight": sigma_attn, "blocks.0.attn.c_attn.weight[q]": 0.5,
                              "blocks.0.mlp.c_fc.weight": sigma_mlp, "blocks.0.mlp.c_proj.weight": 0.1},
                "eval_ms": 100.0, "diagnostics_ms": 2.0}) + "\n")
    if summary is not None:
        with open(os.path.join(folder, "summary.json"), "w") as f:
            json.dump(summary, f)
    for name in ("metrics.jsonl", "summary.json"):
        if os.path.exists(os.path.join(folder, name)):
            os.utime(os.path.join(folder, name), (started + seconds, started + seconds))


def add_event(folder, row):
    with open(os.path.join(folder, "metrics.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")


def two_runs(root):
    fake_run(root / "hetero", "hetero", [(5, 6.0, 3.0, 1.0, 2.0), (10, 5.5, 4.0, 1.0, 2.5)],
             {"status": "completed", "steps": 10, "tokens": 10000, "final_val_loss": 5.5, "diverged": None},
             started=1000)
    fake_run(root / "hetero-inv", "hetero-inv", [(5, 6.2, 40.0, 7.0, 1.0)],
             {"status": "diverged", "steps": 7, "tokens": 7000, "final_val_loss": 6.2,
              "diverged": {"step": 7, "train_loss": 99.0}}, started=2000)


def table_rows(text):
    return [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()
            if line.startswith("| `")]


def test_report_of_two_runs_gives_the_table_and_a_figure(tmp_path):
    two_runs(tmp_path)
    report.write_report([str(tmp_path)])
    text = (tmp_path / "report.md").read_text()
    rows = table_rows(text)
    assert [r[0] for r in rows] == ["`hetero`", "`hetero-inv`"]  # the order they started in
    hetero, inverse = rows
    # assignment, final val loss, steps, tokens, tokens/s, optimizer share, max logit, max sigma attn, MLP
    assert hetero == ["`hetero`", "5.5000", "10", "10,000", "5,500", "25%", "4.00", "1.000", "2.500"]
    assert inverse[1] == "diverged at step 7" and inverse[2] == "7" and inverse[6] == "40.00"
    assert inverse[7] == "7.000" and inverse[8] == "1.000"
    assert "2.0 ms, 2.0% of the validation-loss pass" in text
    png = (tmp_path / "report.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000


def test_report_cli_on_run_folders_and_its_mistakes(tmp_path):
    two_runs(tmp_path / "runs")
    fake_run(tmp_path / "killed", "all-dgram", [], None, started=3000)  # no summary.json
    cli = [sys.executable, "-m", "tools.report"]
    result = subprocess.run([*cli, str(tmp_path / "runs" / "hetero"), str(tmp_path / "killed"),
                             "--out", str(tmp_path / "cmp")], capture_output=True, text=True, timeout=120,
                            cwd=ROOT)
    assert result.returncode == 0, result.stderr
    rows = table_rows(result.stdout)
    assert [r[0] for r in rows] == ["`hetero`", "`all-dgram`"]
    assert rows[1][1] == "no summary.json (running or killed) at step 10" and rows[1][6] == "n/a"
    assert (tmp_path / "cmp" / "report.png").exists()
    for args, message in [([str(tmp_path / "cmp")], "holds no run"),
                          ([str(tmp_path / "runs"), str(tmp_path / "killed")], "--out"),
                          ([str(tmp_path / "nothing")], "is not a folder")]:
        result = subprocess.run([*cli, *args], capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert result.returncode == 2 and result.stderr.startswith("error: ") and message in result.stderr


def test_seeds_of_one_assignment_are_summarised(tmp_path):
    for i, (seed, final) in enumerate([("s1", 5.5), ("s2", 5.7)]):
        fake_run(tmp_path / seed / "hetero", "hetero", [(10, final, 4.0, 1.0, 2.0)],
                 {"status": "completed", "steps": 10, "tokens": 10000, "final_val_loss": final, "diverged": None},
                 started=1000 + i)
        fake_run(tmp_path / seed / "auto", "auto", [(10, 6.0, 9.0, 1.0, 2.0)],
                 {"status": "completed", "steps": 10, "tokens": 10000, "final_val_loss": 6.0, "diverged": None,
                  "auto_switches": [{"step": 5, "layer": 1, "reason": "x"}]}, started=2000 + i)
        add_event(tmp_path / seed / "auto", {"step": 5, "layer": 1, "reason": "x", "event": "auto_switch"})
    report.write_report([str(tmp_path / "s1"), str(tmp_path / "s2")], str(tmp_path))
    text = (tmp_path / "report.md").read_text()
    rows = table_rows(text)
    hetero = next(r for r in rows if r[0] == "`hetero`")
    # assignment, runs, mean ± sd, min – max, diverged, median max logit, median final max prob
    assert hetero == ["`hetero`", "2", "5.6000 ± 0.1414", "5.5000 – 5.7000", "0/2", "4.0", "0.90"]
    assert "6.0000 (auto: layer 1 at step 5)" in text
    assert "`hetero (s1)`" in text and "`hetero (s2)`" in text


def test_solver_guard_table_gives_the_setting_gap_and_the_seed_spread(tmp_path):
    from bench.experiments import solver_guard_plot
    finals = {("default", "seed1"): 5.40, ("default", "seed2"): 5.43,
              ("iters20", "seed1"): 5.41, ("iters20", "seed2"): 5.42}
    for (setting, seed), val in finals.items():
        fake_run(tmp_path / setting / seed / "hetero", "hetero", [(5, 6.0, 3.0, 1.0, 2.0), (10, val, 3.0, 1.0, 2.0)],
                 {"status": "completed", "steps": 10, "tokens": 10000, "final_val_loss": val, "diverged": None},
                 started=1000)
    solver_guard_plot.main([str(tmp_path)])
    row = open(tmp_path / "guard.md").read().splitlines()[-1]
    # gap: max over seeds of |default - iters20| = 0.01; spread: max over settings of max - min = 0.03
    assert row == "| hetero | 5.4000, 5.4300 | 5.4100, 5.4200 | 0.0100 | 0.0300 |"
    assert (tmp_path / "guard.png").stat().st_size > 0


def test_runs_with_attention_stabilizers_are_their_own_rows(tmp_path):
    done = {"status": "completed", "steps": 10, "tokens": 10000, "final_val_loss": 6.0, "diverged": None}
    fake_run(tmp_path / "a", "all-dgram", [(10, 6.0, 9.0, 1.0, 2.0)], done, started=1000)
    fake_run(tmp_path / "b", "all-dgram", [(10, 5.8, 9.0, 1.0, 2.0)], done, started=2000)
    with open(tmp_path / "b" / "config.json", "w") as f:
        json.dump({"assign": "all-dgram", "tokens_per_step": 1000, "qk_clip": 100.0, "attn_softcap": 50.0,
                   "qk_norm": False}, f)
    labels = [r.label for r in report.find_runs([str(tmp_path)])]
    assert labels == ["all-dgram", "all-dgram +qk-clip 100 +softcap 50"]


def test_runs_that_overlapped_in_time_are_said_to_share_the_machine(tmp_path):
    done = {"status": "completed", "steps": 10, "tokens": 10000, "final_val_loss": 6.0, "diverged": None}
    fake_run(tmp_path / "a", "hetero", [(10, 6.0, 3.0, 1.0, 2.0)], done, started=1000)
    fake_run(tmp_path / "b", "all-dgram", [(10, 6.1, 3.0, 1.0, 2.0)], done, started=1050)  # beside a
    fake_run(tmp_path / "c", "all-stiefel", [(10, 6.2, 3.0, 1.0, 1.0)], done, started=1200)  # alone, after
    report.write_report([str(tmp_path)])
    text = (tmp_path / "report.md").read_text()
    speeds = {r[0]: r[4] for r in table_rows(text)}
    assert speeds == {"`hetero`": "5,500 (shared)", "`all-dgram`": "5,500 (shared)", "`all-stiefel`": "5,500"}
    assert "- `hetero` with `all-dgram`" in text and "- `all-dgram` with `hetero`" in text
    assert "`all-stiefel` with" not in text
    two_runs(tmp_path / "apart")  # one after the other: no note
    report.write_report([str(tmp_path / "apart")])
    assert "shared the machine" not in (tmp_path / "apart" / "report.md").read_text()


def test_the_figure_shows_the_final_spread_and_fits_its_axes(tmp_path):
    # three runs 0.02 nats apart at the end of a 10 -> 6 descent; Stiefel sigmas at exactly 1
    done = {"status": "completed", "steps": 30, "tokens": 30000, "diverged": None}
    for k, assign in enumerate(["hetero", "all-stiefel", "all-dgram"]):
        evals = [(step, 6.0 + 4.0 / step + 0.02 * k, 2.0 + step / 10, 1.0, 1.0 if assign == "all-stiefel" else 2.0)
                 for step in range(1, 31)]
        fake_run(tmp_path / assign, assign, evals, {**done, "final_val_loss": evals[-1][1]}, started=1000 * k)
    fig = report.draw(report.find_runs([str(tmp_path)]))
    loss_ax, logit_ax, sigma_ax, prob_ax = fig.axes[:4]
    (inset,) = loss_ax.child_axes
    low, high = inset.get_ylim()  # the last third's values: the 0.04 between first and last run is most of it
    assert low < 6.0 + 4 / 30 < 6.04 + 4 / 30 < high and high - low < 0.2
    assert logit_ax.get_yscale() == "linear"  # 2.1 to 5: under a decade
    assert prob_ax.get_ylim()[0] > 0.8 and prob_ax.get_ylim()[1] <= 1  # the data: 0.9 throughout
    at_one = [tuple(line.get_xdata()[:1]) for line in sigma_ax.lines if set(line.get_ydata()) == {1.0}]
    assert len(at_one) == 4 and len(set(at_one)) == 4  # hetero attn, all-stiefel attn and MLP, all-dgram attn
    blown = report.Run(str(tmp_path / "hetero"))
    blown.evals = [{**e, "attn_logit_max": [1.0, 300.0 if e["step"] > 20 else 2.0]} for e in blown.evals]
    logit_ax = report.draw([blown]).axes[1]
    assert logit_ax.get_yscale() == "log"  # above a decade: 1-2-5 ticks
    ticks = [t for t in logit_ax.get_yticks() if logit_ax.get_ylim()[0] <= t <= logit_ax.get_ylim()[1]]
    assert set(ticks) <= {1, 2, 5, 10, 20, 50, 100, 200, 500} and len(ticks) >= 4
