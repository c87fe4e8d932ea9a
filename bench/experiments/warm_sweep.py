"""How the ADMM warm start's penalty and iteration budget are measured (the figures: docs/solver-tuning.md).

    OMP_NUM_THREADS=1 python -m bench.experiments.warm_sweep
    OMP_NUM_THREADS=1 python -m bench.experiments.warm_sweep --penalties 0.1 --iterations 4 --clip polynomial \
        --precision fp32 tf32 bf16         (the inner iterations' precision, as a GPU runs them)
    OMP_NUM_THREADS=1 python -m bench.experiments.warm_sweep --penalties 0.1 --growth 1 2 --iterations 4 \
        --clip polynomial --precision tf32 --momenta runs/momenta-hetero-256-long.pt   (a growing penalty)
    python -m bench.experiments.warm_sweep --penalties 0.07 --iterations 3 --clip polynomial --precision tf32 \
        --shapes 2304x768:stiefel 3072x768:dgram          (GPT-2-small shapes; minutes per reference)

For a 768x256 Stiefel and a 1024x256 DGram matrix (or --shapes) and 4 drifting momentum-like gradients, runs
the solver step after step (each warm-started from the one before, as the optimizer does) for
every penalty x over-relaxation x iteration budget, and prints the last step's direction
quality against the float64 optimum (manifolds/optimum.py); then the cold-start quality of a
few penalties (the first step of a run has no warm start).

With --momenta FILE (bench/dump_momenta.py: weights and momenta recorded from a training run)
the cases are real instead: each window of consecutive recorded steps is replayed through
solve_tall_banks as the optimizer runs it (every bank, warm starts chained, the first step of a
window cold), and each cell is the worst and the mean quality over the constrained matrices of a
bank at the window's last step. The float64 optima are cached in FILE.optima.pt.

What limits the online scheme (docs/solver-tuning.md, "Where the online scheme stops"): --dual-step,
--online-steps N (dual steps per warm step) and --exact-sign (its matrix sign by a float64 SVD), e.g.

    OMP_NUM_THREADS=2 python -m bench.experiments.warm_sweep --momenta runs/momenta-hetero-768.pt --per-bank 1 \
        --penalties 0.07 --iterations 3 --clip polynomial --precision tf32 --scheme online \
        --reference-iters 600 --reference-tol 1e-4 --online-steps 16 --exact-sign
"""
import argparse
import contextlib
import os

import torch

from bench.optimizer import momentum_like
from bench.solver_quality import shape_parser
from manifolds import project_to_manifold, solver
from manifolds.solver import solve_tall, solve_tall_banks
from manifolds.geometry import MANIFOLDS, geometry
from manifolds.optimum import optimum, quality
from manifolds.plan import SolverOptions, plan_for


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--penalties", type=float, nargs="+", default=[0.05, 0.1, 0.25, 0.5],
                    help="the warm penalty (SolverOptions.rho_warm; the cold rows' rho), each a row")
    ap.add_argument("--relax", type=float, nargs="+", default=[SolverOptions().relax],
                    help="ADMM's over-relaxation (SolverOptions.relax), each a row")
    ap.add_argument("--growth", type=float, nargs="+", default=[SolverOptions().rho_growth],
                    help="the warm penalty's growth per iteration (SolverOptions.rho_growth), each a row")
    ap.add_argument("--warm-average", type=float, nargs="+", default=[SolverOptions().warm_average],
                    help="the share of the previous warm start kept in the next (SolverOptions.warm_average), "
                         "each a row")
    ap.add_argument("--pullbacks", type=int, nargs="+", default=[SolverOptions().pullbacks],
                    help="rounds of Proj_T(pull_back(.)) on ADMM's answer (SolverOptions.pullbacks), each a row")
    ap.add_argument("--iterations", type=int, nargs="+", default=[4, 5, 6, 8],
                    help="warm iteration budgets (SolverOptions.iterations), each a column")
    ap.add_argument("--clip", default="auto", choices=("auto", "eigh", "polynomial"),
                    help="ADMM's clip (auto = eigh on this CPU; polynomial is what a GPU runs)")
    ap.add_argument("--precision", nargs="+", default=["fp32"], choices=("fp32", "tf32", "bf16"),
                    help="the inner iterations' precision (SolverOptions.precision; tf32 emulated on CPU), "
                         "each a row")
    ap.add_argument("--scheme", nargs="+", default=["online"], choices=("online", "admm", "newton"),
                    help="the solver scheme (SolverOptions.scheme; online and newton: the penalties, growth, relax, "
                         "warm average and pullbacks do not apply), each a row")
    ap.add_argument("--momenta", default=None, help="replay real momenta from bench/dump_momenta.py")
    ap.add_argument("--shapes", nargs="+", type=shape_parser(("stiefel", "dgram"), square=True), default=[(768, 256, "stiefel"), (1024, 256, "dgram")],
                    metavar="ROWSxCOLS:MANIFOLD",
                    help="the synthetic cases, tall (default 768x256:stiefel 1024x256:dgram; GPT-2 small: "
                         "2304x768:stiefel 3072x768:dgram)")
    ap.add_argument("--per-bank", type=int, default=0,
                    help="--momenta: certify only the first N matrices of each bank (0 = all) and skip square "
                         "banks (Stiefel's closed-form step): each float64 reference at width 768 takes minutes")
    ap.add_argument("--reference-iters", type=int, default=800,
                    help="most iterations of the float64 reference ADMM (its certified gap is printed)")
    ap.add_argument("--reference-tol", type=float, default=1e-6,
                    help="the reference stops once its certified relative gap is under this")
    ap.add_argument("--dual-step", type=float, default=None,
                    help="the online scheme's dual step, Stiefel's included (SolverOptions.dual_step and "
                         "stiefel_dual_step; default: theirs)")
    ap.add_argument("--online-steps", type=int, default=None,
                    help="the online scheme's dual steps per warm step (geometry's online_steps, 1 on Stiefel and "
                         "DGram): how far more of them would take it")
    ap.add_argument("--exact-sign", action="store_true",
                    help="the online scheme's matrix sign by a float64 SVD instead of its polynomial (whether the "
                         "polynomial's band of singular values is what it loses)")
    args = ap.parse_args()
    with online_variant(args):
        if args.momenta:
            return replay(args)
        sweep(args)


@contextlib.contextmanager
def online_variant(args):
    """--online-steps and --exact-sign in force (diagnostics of the online scheme: what limits it)."""
    saved_polar = solver.polar
    saved_steps = {cls: cls.online_steps for cls in {type(m) for m in MANIFOLDS.values()}}
    try:
        if args.exact_sign:
            def exact_polar(Y, plan, steps=None):
                U, _, Vh = torch.linalg.svd(Y.double(), full_matrices=False)
                return (U @ Vh).to(Y.dtype)
            solver.polar = exact_polar
        if args.online_steps is not None:
            for cls in saved_steps:
                if not cls.secant_dual:
                    cls.online_steps = args.online_steps
        yield
    finally:
        solver.polar = saved_polar
        for cls, steps in saved_steps.items():
            cls.online_steps = steps


def sweep(args):
    g = torch.Generator().manual_seed(1)
    cases = []
    for p, q, manifold in args.shapes:
        W = project_to_manifold(torch.randn(p, q, generator=g) * 0.02, manifold)[None]
        base = momentum_like((p, q), g)
        Gs = [(0.9 * base + 0.1 * momentum_like((p, q), g))[None] for _ in range(4)]
        # In span coordinates (2q x q) the reference costs the same at any row count: exact, and
        # what makes GPT-2-small shapes affordable on a CPU.
        opt, upper = optimum(W[0].double(), Gs[-1][0].double(), manifold, iters=args.reference_iters, in_span=True,
                              tol=args.reference_tol)
        print(f"reference {p}x{q} {manifold}: optimum {opt:.6f}, certified within {abs(upper - opt) / upper:.1e}",
              flush=True)
        cases.append((W, Gs, manifold, opt))
    names = [f"{m} {W.size(-2)}x{W.size(-1)} {it} it." for it in args.iterations for W, _, m, _ in cases]
    print(f"warm, the 4th step, clip {args.clip}:  scheme [penalty growth relax] precision [warm-average pullbacks] | "
          + " | ".join(names))
    for row in setting_rows(args):
        qualities = []
        for it in args.iterations:
            for W, Gs, manifold, opt in cases:
                plan = row_plan(args, row, it)
                state = None
                for G in Gs:
                    solution = solve_tall(W, G, geometry(manifold), state, plan)
                    state = solution.warm_start
                qualities.append(quality(W[0].double(), Gs[-1][0].double(), solution.A[0].double(), opt))
        print(f"{row_label(row)} | " + " | ".join(f"{x:.4f}" for x in qualities), flush=True)
    print("cold (first step, 6 iterations):  penalty | " + " | ".join(m for _, _, m, _ in cases))
    for penalty in args.penalties:
        cold = plan_for(SolverOptions(scheme="admm", iterations=3, tol=0, rho=penalty), "cpu")
        row = [quality(W[0].double(), Gs[-1][0].double(),
                       solve_tall(W, Gs[-1], geometry(m), None, cold).A[0].double(), opt)
               for W, Gs, m, opt in cases]
        print(f"{penalty:7.3f} | " + " | ".join(f"{x:.4f}" for x in row), flush=True)


def row_plan(args, row, iterations):
    """The CPU SolverPlan of one row of the sweep at an iteration budget (fixed budgets, sync-free)."""
    scheme, penalty, growth, relax, precision, average, pullbacks = row
    dual = {} if args.dual_step is None else {"dual_step": args.dual_step, "stiefel_dual_step": args.dual_step}
    return plan_for(SolverOptions(scheme=scheme, iterations=iterations, pullbacks=pullbacks, tol=0, rho_warm=penalty,
                                  rho_growth=growth, relax=relax, warm_average=average, clip=args.clip,
                                  precision=precision, capturable=True, **dual), "cpu")


def row_label(row):
    scheme, penalty, growth, relax, precision, average, pullbacks = row
    if scheme in ("online", "newton"):
        return f"{scheme} {precision}"
    return f"admm {penalty:7.3f} {growth:4.1f} {relax:5.2f} {precision} {average:.2f} {pullbacks}"


def setting_rows(args):
    """Rows of the sweep: ADMM's settings crossed; the online scheme's by precision only (it reads none of them)."""
    rows = []
    for scheme in args.scheme:
        if scheme in ("online", "newton"):  # neither reads ADMM's settings
            rows += [(scheme, args.penalties[0], args.growth[0], args.relax[0], precision, args.warm_average[0],
                      args.pullbacks[0]) for precision in args.precision]
            continue
        rows += [("admm", penalty, growth, relax, precision, average, pullbacks) for penalty in args.penalties
                 for growth in args.growth for relax in args.relax for precision in args.precision
                 for average in args.warm_average for pullbacks in args.pullbacks]
    return rows


def windows(steps):
    """Indices of the recorded steps grouped into runs of consecutive steps."""
    groups = []
    for i, step in enumerate(steps):
        if groups and step == steps[groups[-1][-1]] + 1:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def replay(args):
    record = torch.load(args.momenta)
    cap = record.get("dgram_cap", 1.0)
    cache_path = args.momenta + ".optima.pt"
    optima = torch.load(cache_path) if os.path.exists(cache_path) else {}
    cases = []  # (label, [banks of each step], {(bank, matrix): optimum})
    for window in windows(record["steps"]):
        steps = [record["banks"][i] for i in window]
        last = record["steps"][window[-1]]
        targets = {}
        for b, (_, manifold, W, G) in enumerate(steps[-1]):
            if manifold == "none" or (args.per_bank and W.size(-1) == W.size(-2)):
                continue
            for m in range(min(W.size(0), args.per_bank or W.size(0))):
                # cached per reference budget: a looser earlier reference is not reused for a tighter one
                key = (last, b, m, args.reference_iters, args.reference_tol)
                if key not in optima:
                    optima[key] = optimum(W[m].double(), G[m].double(), manifold, iters=args.reference_iters,
                                          in_span=True, tol=args.reference_tol)
                    torch.save(optima, cache_path)
                value, upper = optima[key]
                print(f"reference step {last} bank {b} matrix {m} ({manifold}): optimum {value:.6f}, "
                      f"certified within {(upper - value) / upper:.1e}", flush=True)
                targets[(b, m)] = value
        cases.append((last, steps, targets))
    names = [f"step {last} {steps[-1][b][1]} {'x'.join(map(str, steps[-1][b][2].shape[1:]))}"
             for last, steps, targets in cases for b in sorted({b for b, _ in targets})]
    print(f"real momenta ({args.momenta}), warm-started through each window, clip {args.clip}; worst / mean "
          "quality of a bank's matrices:  scheme [penalty growth relax] precision [warm-average pullbacks] iterations | "
          + " | ".join(names))
    for row in setting_rows(args):
        for it in args.iterations:
            plan = row_plan(args, row, it)
            cells = []
            for _, steps, targets in cases:
                states = [None] * len(steps[0])
                for banks in steps:
                    solutions = solve_tall_banks([(W, G, geometry(manifold, cap), state)
                                                  for (_, manifold, W, G), state in zip(banks, states)], plan)
                    states = [solution.warm_start for solution in solutions]
                for b in sorted({b for b, _ in targets}):
                    _, _, W, G = steps[-1][b]
                    values = [quality(W[m].double(), G[m].double(), solutions[b].A[m].double(), targets[(b, m)])
                              for bb, m in targets if bb == b]
                    cells.append(f"{min(values):.4f} / {sum(values) / len(values):.4f}")
            print(f"{row_label(row)} {it} | " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
