"""How close each solver scheme's direction comes to the steepest one (issue 60's table, as a tool).

    OMP_NUM_THREADS=1 python -m bench.solver_quality                       # every scheme, the default cases
    OMP_NUM_THREADS=1 python -m bench.solver_quality --schemes online admm --seeds 0 1 2
    OMP_NUM_THREADS=1 python -m bench.solver_quality --shapes 192x64:stiefel --decays 1 2

Cases: a point W of each manifold (DGram and Oblique with column norms spread by exp(0.3 N(0, 1)))
and a drifting sequence of momentum-like gradients (bench.optimizer.momentum_like: singular values
s_i ~ i^-decay plus noise; G_t = 0.9 G_(t-1) + 0.1 fresh, as a momentum buffer drifts). decay 1
is the usual momentum; decay 2 is nearly low-rank (half of the spectrum below 1e-3 of its top at
q = 64), where undamped Newton steps on the multiplier fail.

Each cell is the direction quality <G/|G|, A> / ||A||_op as a fraction of the float64 optimum of the
last step's problem (manifolds/optimum.py, certified by duality; its certified gap is printed):
  warm  the scheme run through the whole sequence, each step from the previous step's multiplier
        (solve_tall with the carried state, as ManifoldMuon runs it), scored at the last step;
  cold  manifolds.steepest_direction(..., scheme=<the scheme>) on the last step (the one-shot
        public API, no warm start);
  default cold  steepest_direction with no scheme named, as users call it (its own solver: ADMM
        from a cold start to convergence-sized budgets, manifolds/plan.py's one_shot_options).
Worst / mean over the seeds. The plan is the CPU's with a GPU's control flow (capturable: fixed
budgets, no host reads), fp32 (--precision tf32: a GPU's default precision, emulated).
"""
import argparse

import torch

from bench.optimizer import momentum_like
from manifolds import project_to_manifold, steepest_direction
from manifolds.solver import solve_tall
from manifolds.geometry import geometry
from manifolds.optimum import optimum, quality
from manifolds.plan import SCHEMES, SolverOptions, plan_for

DEFAULT_SHAPES = ["96x32:stiefel", "96x32:dgram", "96x32:oblique", "192x64:stiefel", "192x64:dgram",
                  "192x64:oblique"]


def shape_parser(manifolds=("stiefel", "dgram", "oblique"), square=False):
    """An argparse type: "96x32:dgram" -> (96, 32, "dgram"), a tall matrix (rows > cols, or rows >=
    cols with `square`) on one of `manifolds` (bench/experiments/warm_sweep.py takes square ones)."""
    relation = ">=" if square else ">"

    def parse(text):
        try:
            dims, manifold = text.split(":")
            rows, cols = (int(d) for d in dims.lower().split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected ROWSxCOLS:MANIFOLD such as 96x32:stiefel, got {text!r}")
        if manifold not in manifolds or not cols > 0 or not (rows >= cols if square else rows > cols):
            raise argparse.ArgumentTypeError(f"expected a tall shape (rows {relation} cols) on "
                                             f"{', '.join(manifolds)}, got {text!r}")
        return rows, cols, manifold
    return parse


parse_shape = shape_parser()


def case(rows, cols, manifold, decay, seed, steps, spread=0.3):
    """(W (1, p, q) float32 on the manifold, [G_t (1, p, q) float32]) of one seed."""
    g = torch.Generator().manual_seed(1000 * seed + 17 * rows + cols)
    W = torch.randn(rows, cols, generator=g, dtype=torch.float64)
    W = project_to_manifold(W * torch.exp(spread * torch.randn(cols, generator=g, dtype=torch.float64)), manifold)
    G = momentum_like((rows, cols), g, decay).double()
    Gs = []
    for _ in range(steps):
        G = 0.9 * G + 0.1 * momentum_like((rows, cols), g, decay).double()
        Gs.append(G.float()[None])
    return W.float()[None], Gs


def scheme_plan(scheme, precision="fp32"):
    return plan_for(SolverOptions(scheme=scheme, capturable=True, precision=precision), "cpu")


def warm_quality(W, Gs, manifold, scheme, opt, precision="fp32"):
    geo, plan, state = geometry(manifold), scheme_plan(scheme, precision), None
    for G in Gs:
        solution = solve_tall(W, G, geo, state, plan)
        state = solution.warm_start
    return quality(W[0], Gs[-1][0], solution.A[0], opt)


def cold_quality(W, G, manifold, scheme, opt, precision="fp32"):
    """Quality of the one-shot API's answer; scheme None: the default a caller naming none gets."""
    named = {} if scheme is None else {"scheme": scheme}
    A = steepest_direction(W[0], G[0], manifold, capturable=True, precision=precision, **named)
    return quality(W[0], G[0], A, opt)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=SCHEMES)
    ap.add_argument("--shapes", nargs="+", type=parse_shape, default=[parse_shape(s) for s in DEFAULT_SHAPES],
                    metavar="ROWSxCOLS:MANIFOLD")
    ap.add_argument("--decays", nargs="+", type=float, default=[1.0, 2.0],
                    help="spectral decay of the momenta (1: momentum-like, 2: nearly low-rank)")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    ap.add_argument("--steps", type=int, default=4, help="drifting steps of the warm sequence")
    ap.add_argument("--reference-iters", type=int, default=3000)
    ap.add_argument("--precision", default="fp32", choices=("fp32", "tf32"),
                    help="the solver's precision (tf32: a GPU's default, its TF32 products emulated on the CPU by "
                         "rounding their operands; the signs then run in bf16)")
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    header = ("case (rows x cols manifold decay) | " + " | ".join(f"{s} warm | {s} cold" for s in args.schemes)
              + " | default cold")
    print(header)
    print("|".join("---" for _ in header.split("|")))
    for rows, cols, manifold in args.shapes:
        for decay in args.decays:
            cells = {(s, kind): [] for s in args.schemes for kind in ("warm", "cold")}
            cells[(None, "cold")] = []
            gaps = []
            for seed in args.seeds:
                W, Gs = case(rows, cols, manifold, decay, seed, args.steps)
                opt, upper = optimum(W[0], Gs[-1][0], manifold, iters=args.reference_iters, in_span=manifold != "oblique")
                gaps.append((upper - opt) / upper)
                for s in args.schemes:
                    cells[(s, "warm")].append(warm_quality(W, Gs, manifold, s, opt, args.precision))
                    cells[(s, "cold")].append(cold_quality(W, Gs[-1], manifold, s, opt, args.precision))
                cells[(None, "cold")].append(cold_quality(W, Gs[-1], manifold, None, opt, args.precision))
            text = " | ".join(f"{min(v):.4f} / {sum(v) / len(v):.4f}" for v in cells.values())
            print(f"{rows}x{cols} {manifold} {decay:g} | {text}   (reference gap <= {max(gaps):.0e})", flush=True)


if __name__ == "__main__":
    main()
