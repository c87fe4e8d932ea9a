"""How the ADMM warm start's penalty and iteration budget were chosen (bench/RESULTS.md).

    OMP_NUM_THREADS=1 python bench/warm_sweep.py
    OMP_NUM_THREADS=1 python bench/warm_sweep.py --penalties 0.1 --iterations 4 --clip polynomial \
        --precision fp32 tf32 bf16         (the inner iterations' precision, as a GPU runs them)

For a 768x256 Stiefel and a 1024x256 DGram matrix and 4 drifting momentum-like gradients, runs
the solver step after step (each warm-started from the one before, as the optimizer does) for
every penalty x over-relaxation x iteration budget, and prints the last step's direction
quality against the float64 optimum (tests/reference.py); then the cold-start quality of a
few penalties (the first step of a run has no warm start).
"""
import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
from bench.optimizer import momentum_like  # noqa: E402
from manifolds import project_to_manifold  # noqa: E402
from manifolds.dual import SolverOptions, solve_tall  # noqa: E402
from reference import optimum, quality  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--penalties", type=float, nargs="+", default=[0.05, 0.1, 0.25, 0.5])
    ap.add_argument("--relax", type=float, nargs="+", default=[1.5])
    ap.add_argument("--iterations", type=int, nargs="+", default=[4, 5, 6, 8])
    ap.add_argument("--clip", default="auto", choices=("auto", "eigh", "polynomial"),
                    help="ADMM's clip (auto = eigh on this CPU; polynomial is what a GPU runs)")
    ap.add_argument("--precision", nargs="+", default=["fp32"], choices=("fp32", "tf32", "bf16"),
                    help="the inner iterations' precision (tf32 emulated on CPU), each a row")
    args = ap.parse_args()
    g = torch.Generator().manual_seed(1)
    cases = []
    for p, q, manifold in [(768, 256, "stiefel"), (1024, 256, "dgram")]:
        W = project_to_manifold(torch.randn(p, q, generator=g) * 0.02, manifold)[None]
        base = momentum_like((p, q), g)
        Gs = [(0.9 * base + 0.1 * momentum_like((p, q), g))[None] for _ in range(4)]
        opt, _ = optimum(W[0].double(), Gs[-1][0].double(), manifold, iters=800)
        cases.append((W, Gs, manifold, opt))
    names = [f"{m} {it} it." for it in args.iterations for _, _, m, _ in cases]
    print(f"warm, the 4th step, clip {args.clip}:  penalty relax precision | " + " | ".join(names))
    rows = [(penalty, relax, precision) for penalty in args.penalties for relax in args.relax for precision in args.precision]
    for penalty, relax, precision in rows:
        row = []
        for it in args.iterations:
            for W, Gs, manifold, opt in cases:
                opts = SolverOptions(admm_steps=it, tol=0, admm_rho_warm=penalty, admm_relax=relax,
                                     clip=args.clip, precision=precision, capturable=True)
                state = None
                for G in Gs:
                    solution = solve_tall(W, G, manifold, state, opts)
                    state = solution.state
                row.append(quality(W[0].double(), Gs[-1][0].double(), solution.A[0].double(), opt))
        print(f"{penalty:7.3f} {relax:5.2f} {precision} | " + " | ".join(f"{x:.4f}" for x in row), flush=True)
    print("cold (first step, 6 iterations):  penalty | " + " | ".join(m for _, _, m, _ in cases))
    for penalty in args.penalties:
        row = [quality(W[0].double(), Gs[-1][0].double(),
                       solve_tall(W, Gs[-1], m, None, SolverOptions(admm_steps=3, tol=0, admm_rho=penalty)).A[0].double(),
                       opt) for W, Gs, m, opt in cases]
        print(f"{penalty:7.3f} | " + " | ".join(f"{x:.4f}" for x in row), flush=True)


if __name__ == "__main__":
    main()
