"""The online scheme's dual iteration in exact arithmetic on recorded momenta: what it reaches when
nothing is rounded, and whether freeing the matrix sign's smallest singular directions helps
(docs/solver-tuning.md, "Where the online scheme stops on recorded momenta").

    OMP_NUM_THREADS=2 python -m bench.experiments.exact_dual --momenta runs/momenta-hetero-768.pt
    OMP_NUM_THREADS=2 python -m bench.experiments.exact_dual --momenta runs/momenta-hetero-768.pt \
        --online-steps 16 --dual-step 0.1 --free-directions 0 1 4

For matrix 0 of every tall constrained bank of each recorded window (bench/dump_momenta.py's format),
the online scheme as solver.online_iterations runs it, but in float64 with the matrix sign by an SVD
and in span coordinates (the 2q x q problem Q^T W, Q^T G of a QR of [W, G]: the same inner products,
tangent projection and operator norm): G scaled to unit Frobenius norm, M0 = multiplier(G), a cold
start of ONLINE_COLD dual steps, then --online-steps a recorded step from the carried multiplier C,

    X = G - W (M0 - 2 C),  A = msign(X),  M = multiplier(A),  C <- C - (dual_step / 2) rms(X) M,

the answer Proj_T(A) sharpened as FullProblem.sharpened does (one Newton-Schulz step, the projection
again; --no-sharpen: without). Each cell is the answer's quality at the window's last step against
the optimum cached by bench.experiments.warm_sweep (FILE.optima.pt, same reference budget; computed
and cached here when absent).

--free-directions K: the sign keeps its value on X's q - K largest singular directions and takes
U_K T V_K^T on the K smallest, T (K x K) the least-squares minimiser of the tangent violation
||multiplier(A)||_F, its singular values clipped to [0, 1] (A stays in the nuclear norm's
subdifferential where those singular values of X are 0). The lead this tests: the optimum's answer
has unit singular values but one, as if the dual optimum X* were singular in one direction, where a
first-order dual step on msign(X) cannot settle.

--spectrum prints, for the last window's last step, the smallest and largest singular values of X.
"""
import argparse
import os

import torch

from bench.experiments.warm_sweep import windows
from manifolds.geometry import geometry
from manifolds.optimum import optimum, quality
from manifolds.plan import ONLINE_COLD


def span_problem(W, G):
    """(Q^T W, Q^T G) for an orthonormal basis Q of span[W, G] (float64), G scaled to ||G||_F = 1."""
    W, G = W.double(), G.double()
    G = G / G.norm()
    q = W.size(-1)
    if W.size(-2) <= 2 * q:
        return W, G
    R = torch.linalg.qr(torch.cat([W, G], dim=-1)).R
    return R[:, :q].contiguous(), R[:, q:].contiguous()


def exact_sign(X, free, multiplier):
    """msign(X) = U V^T, its `free` smallest singular directions given the least-squares T (above)."""
    U, S, Vh = torch.linalg.svd(X, full_matrices=False)
    A = U @ Vh
    if free:
        Uk, Vk = U[:, -free:], Vh[-free:, :].mT
        A = A - Uk @ Vk.mT
        basis = torch.stack([multiplier(Uk[:, i:i + 1] @ Vk[:, j:j + 1].mT).reshape(-1)
                             for i in range(free) for j in range(free)], dim=1)
        T = torch.linalg.lstsq(basis, -multiplier(A).reshape(-1, 1)).solution.reshape(free, free)
        u, s, vh = torch.linalg.svd(T)
        A = A + Uk @ (u * s.clamp(max=1.0)) @ vh @ Vk.mT
    return A, S


def replay(problems, manifold, steps, dual_step, free, sharpen):
    """(answer, X's singular values) at the last of `problems` [(W, G)] (span coordinates), the
    multiplier carried from step to step as the online scheme carries it."""
    geo = geometry(manifold)
    C = None
    for W, G in problems:
        q = W.size(-1)
        d2 = geo.squared_norms(W)
        multiplier = lambda Y: geo.preconditioned(W, Y, d2, 1.0, "torch")  # noqa: E731
        M0 = multiplier(G)
        n = ONLINE_COLD if C is None else steps
        C = torch.zeros(q, q, dtype=W.dtype) if C is None else C
        for _ in range(n):
            X = G - W @ (M0 - 2 * C)
            A, S = exact_sign(X, free, multiplier)
            M = multiplier(A)
            C = C - 0.5 * dual_step * (X.square().sum() / q).sqrt() * M
        B = A - W @ M
        if sharpen and geo.orthogonal_columns:
            B = B @ (1.5 * torch.eye(q, dtype=B.dtype) - 0.5 * B.mT @ B)
            B = B - W @ multiplier(B)
    return B, S


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--momenta", required=True, help="a recorded window (bench/dump_momenta.py)")
    ap.add_argument("--online-steps", type=int, nargs="+", default=[1], help="dual steps per recorded step, each a row")
    ap.add_argument("--dual-step", type=float, nargs="+", default=[0.25], help="the dual step, each a row")
    ap.add_argument("--free-directions", type=int, nargs="+", default=[0, 1], help="K (above), each a row")
    ap.add_argument("--no-sharpen", action="store_true", help="the projected sign, not sharpened")
    ap.add_argument("--reference-iters", type=int, default=600, help="the optimum's ADMM budget (warm_sweep's)")
    ap.add_argument("--reference-tol", type=float, default=1e-4, help="the optimum's relative gap (warm_sweep's)")
    ap.add_argument("--spectrum", action="store_true", help="X's extreme singular values at the end")
    args = ap.parse_args(argv)
    if not os.path.exists(args.momenta):
        ap.error(f"no such file: {args.momenta}")
    record = torch.load(args.momenta)
    cache_path = args.momenta + ".optima.pt"
    optima = torch.load(cache_path) if os.path.exists(cache_path) else {}
    cases = []  # (label, manifold, [(W, G) span problems], optimum value)
    for window in windows(record["steps"]):
        last = record["steps"][window[-1]]
        for b, (name, manifold, W, _) in enumerate(record["banks"][window[-1]]):
            if manifold == "none" or W.size(-1) == W.size(-2):
                continue
            key = (last, b, 0, args.reference_iters, args.reference_tol)
            if key not in optima:
                _, _, W, G = record["banks"][window[-1]][b]
                optima[key] = optimum(W[0].double(), G[0].double(), manifold, iters=args.reference_iters,
                                      in_span=True, tol=args.reference_tol)
                torch.save(optima, cache_path)
            problems = [span_problem(record["banks"][i][b][2][0], record["banks"][i][b][3][0]) for i in window]
            cases.append((f"step {last} {name} ({manifold})", manifold, problems, optima[key][0]))
    print("exact online dual (float64, SVD sign), quality of matrix 0 at each window's last step: "
          "online steps, dual step, free directions | " + " | ".join(label for label, *_ in cases), flush=True)
    spectrum = None
    for steps in args.online_steps:
        for dual_step in args.dual_step:
            for free in args.free_directions:
                cells = []
                for _, manifold, problems, value in cases:
                    B, spectrum = replay(problems, manifold, steps, dual_step, free, not args.no_sharpen)
                    W, G = problems[-1]
                    cells.append(f"{quality(W, G, B, value):.4f}")
                print(f"{steps} {dual_step:g} {free} | " + " | ".join(cells), flush=True)
    if args.spectrum and spectrum is not None:
        print(f"X at the end ({cases[-1][0]}): largest singular value {spectrum[0]:.4g}, smallest "
              + ", ".join(f"{s:.4g}" for s in spectrum[-4:].flip(0)))


if __name__ == "__main__":
    main()
