"""The largest and smallest ||A||_op (float64 SVD) of the solver's directions, which should lie
in [1 - ~1e-3, 1]: steepest_direction over shapes x manifolds x seeds, and solve_tall_banks as
ManifoldMuon calls it (all shapes of a manifold in one call, cold, then warm-started).

    OMP_NUM_THREADS=2 python -m bench.unit_norm --seeds 3 --plans cpu gpu-control-flow tf32

Plans: the CPU's defaults; the GPU's control flow (sync-free, polynomial clip); and that with
TF32 products, emulated on a CPU (kernels/precision.py; slow: half the run).
"""
import argparse
import time

import torch

from manifolds import project_to_manifold, steepest_direction
from manifolds.solver import solve_tall_banks
from manifolds.geometry import geometry
from manifolds.optimum import random_point
from manifolds.plan import SolverOptions, plan_for

SHAPES = [(48, 32), (40, 32), (33, 32), (32, 48), (32, 33), (36, 32), (64, 48), (32, 32), (64, 16), (16, 64),
          (24, 24), (96, 64), (64, 32)]
MANIFOLDS = ["stiefel", "dgram", "oblique", "dgram-cap", "none"]
PLANS = {"cpu": {}, "gpu-control-flow": dict(capturable=True, clip="polynomial"),
         "tf32": dict(capturable=True, clip="polynomial", precision="tf32")}


def point(shape, manifold, seed):
    """random_point; dgram-cap: a DGram point with about half its columns at the cap 1."""
    if manifold != "dgram-cap":
        return random_point(shape, manifold, seed=seed)
    W, G = random_point(shape, "dgram", seed=seed)
    tall = W.mT if shape[0] < shape[1] else W
    return project_to_manifold(W / tall.norm(dim=-2).median(), manifold, 1.0), G


def norms(A):
    return torch.linalg.matrix_norm(A.double(), ord=2).flatten().tolist()


def measure(plan_name, seeds):
    """{(plan, what): (max, min)} over the shapes and seeds."""
    options = PLANS[plan_name]
    found = {}

    def note(key, values, where):
        hi, lo = found.get(key, ((0.0, None), (9.0, None)))
        found[key] = (max(hi, (max(values), where)), min(lo, (min(values), where)))

    for manifold in MANIFOLDS:
        for shape in SHAPES:
            for seed in seeds:
                W, G = point(shape, manifold, seed)
                note((plan_name, manifold), norms(steepest_direction(W, G, manifold, 1.0, **options)), (shape, seed))
    solver = plan_for(SolverOptions(**options), "cpu")
    for manifold in MANIFOLDS:
        for seed in seeds:
            def banks(states, offset):
                out = []
                for i, shape in enumerate(SHAPES):
                    W, G = (torch.stack(X) for X in zip(*[point(shape, manifold, 1000 * seed + 10 * i + j + offset)
                                                          for j in range(3)]))
                    W, G = (W.mT, G.mT) if shape[0] < shape[1] else (W, G)
                    out.append((W, G, geometry(manifold, 1.0), None if states is None else states[i]))
                return out
            cold = solve_tall_banks(banks(None, 0), solver)
            warm = solve_tall_banks(banks([s.warm_start for s in cold], 5), solver)
            for shape, c, w in zip(SHAPES, cold, warm):
                note((plan_name, manifold + " banks cold"), norms(c.A), (shape, seed))
                note((plan_name, manifold + " banks warm"), norms(w.A), (shape, seed))
    return found


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--plans", nargs="+", default=list(PLANS), choices=list(PLANS))
    args = ap.parse_args()
    start, found = time.time(), {}
    for plan_name in args.plans:
        found.update(measure(plan_name, range(args.seeds)))
    for (plan_name, what), ((hi, hi_at), (lo, lo_at)) in found.items():
        print(f"{plan_name:16s} {what:22s} max {hi:.7f} {hi_at}  min {lo:.7f} {lo_at}")
    highest = max(hi for (hi, _), _ in found.values())
    lowest = min(lo for _, (lo, _) in found.values())
    print(f"all: max ||A||_op {highest:.7f}, min {lowest:.7f} ({time.time() - start:.0f} s)")


if __name__ == "__main__":
    main()
