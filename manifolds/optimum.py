"""The certified float64 optimum of the steepest direction, which tests and bench/ measure
the solver's directions against (`quality`).

It solves  max <G, A>  s.t.  ||A||_op <= 1,  A tangent  by the ADMM of manifolds/reference.py
with residual balancing and exact SVD clips (no Newton-Schulz, no dual ascent: nothing shared
with the solver under test but the tangent projection of manifolds/geometry.py, which the
reference's own projection checks in tests/test_reference.py). Its optimality is certified by
weak duality: for any N in the normal space, <G, A> <= ||G - N||_* for every feasible A.
"""
import torch

from manifolds.geometry import geometry, project_to_manifold
from manifolds.reference import spectral_clip


def optimum(W, G, manifold, iters=3000, in_span=False, tol=1e-9, check_every=50):
    """(optimal value of <G/|G|, A>, certified upper bound) on the tall orientation.

    ADMM with residual balancing (Boyd et al. 2011, 3.4.1): every 10 iterations rho doubles or
    halves when one residual is 10x the other; the scaled dual U = y / rho is rescaled with it,
    so y is unchanged. On ill-conditioned momenta of a trained model a fixed rho left gaps up to
    1.7e-2 after 600 iterations; balancing brought 7 of 8 such matrices under 1e-4 (the eighth
    stayed at 8e-3, so read the returned bound, not only the value). Every check_every
    iterations the primal value and the bound are evaluated (both are valid for any iterate:
    the best of each is kept), and it stops once the relative gap is under tol.

    in_span=True (rows > 2 cols): the same ADMM on the 2q x q problem (Q^T W, Q^T G), Q an
    orthonormal basis of span[W, G] from a float64 QR. Every iterate stays in that span (the
    tangent projection subtracts W M, the clip acts on the right), and <G, A>, ||A||_op, the
    tangent projection and the nuclear norm of the certificate are the same in an orthonormal
    basis: the same optimum at a fraction of the cost for GPT-2-small shapes (3072 x 768)."""
    geo = geometry(manifold)
    W, G = W.double(), G.double()
    if W.size(-2) < W.size(-1):
        W, G = W.mT, G.mT
    if in_span and W.size(-2) > 2 * W.size(-1):
        R = torch.linalg.qr(torch.cat([W, G], dim=-1)).R  # [W, G] = Q R: Q^T W, Q^T G are R's halves
        W, G = R[..., :, :W.size(-1)], R[..., :, W.size(-1):]
    return certified_admm(G, lambda Y: geo.tangent_projection(W, Y), iters, tol, check_every)


def certified_admm(G, project, iters, tol, check_every):
    """(best primal value, best certified upper bound) of  max <G/|G|, A>  s.t.  ||A||_op <= 1,
    A in the closed convex cone that `project` projects onto (a tangent space, or dgram-cap's
    tangent cone), by ADMM with exact SVD clips and residual balancing (see `optimum`).

    The bound: for N in the polar cone, <N, A> <= 0 on the cone, so <G, A> <= <G - N, A> <=
    ||G - N||_*. At the optimum G - rho U is normal; for any iterate N = x - project(x) with
    x = G - rho U lies in the polar cone (Moreau's decomposition; for a subspace, its
    orthogonal complement), so every iterate gives a valid bound."""
    G = G / G.norm()
    rho = torch.linalg.matrix_norm(project(G), ord=2)
    Z, U = torch.zeros_like(G), torch.zeros_like(G)
    best_primal, best_upper = -float("inf"), float("inf")
    for k in range(1, iters + 1):
        B = project(Z - U + G / rho)
        Z_prev, Z = Z, spectral_clip(B + U)
        U = U + B - Z
        if k % 10 == 0:
            primal_residual, dual_residual = (B - Z).norm(), rho * (Z - Z_prev).norm()
            if primal_residual > 10 * dual_residual:
                rho, U = rho * 2, U / 2
            elif dual_residual > 10 * primal_residual:
                rho, U = rho / 2, U * 2
        if k % check_every == 0 or k == iters:
            B = project(Z - U + G / rho)
            best_primal = max(best_primal, float((G * B).sum() / torch.linalg.matrix_norm(B, ord=2)))
            x = G - rho * U
            best_upper = min(best_upper, float(torch.linalg.matrix_norm(G - (x - project(x)), ord="nuc")))
            if best_upper - best_primal <= tol * abs(best_upper):
                break
    return best_primal, best_upper


def quality(W, G, A, opt):
    """<G/|G|, A> / ||A||_op as a fraction of the optimum."""
    G, A = G.double(), A.double()
    return float((G / G.norm() * A).sum() / torch.linalg.matrix_norm(A, ord=2)) / opt


def random_point(shape, manifold, seed, spread=0.3):
    """A random test problem: a point W of the manifold (DGram: column norms spread by
    exp(spread * N(0, 1))) and a random G, float32."""
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(shape, generator=g, dtype=torch.float64)
    tall = W.mT if shape[-2] < shape[-1] else W
    tall = tall * torch.exp(spread * torch.randn(tall.size(-1), generator=g, dtype=torch.float64))
    W = tall.mT if shape[-2] < shape[-1] else tall
    W = project_to_manifold(W, manifold)
    G = torch.randn(shape, generator=g, dtype=torch.float64)
    return W.float(), G.float()


def cone_projection(W, A, capped):
    """Euclidean projection onto dgram-cap's tangent cone at W = Q D (float64, exact).

    The normal directions W (E_ij + E_ji) (i != j) and W E_ii are mutually orthogonal because
    W^T W is diagonal, so the projection splits: DGram's subspace projection, then for each
    capped column i with w_i . a_i < 0 the component along w_i removed (w_i . a_i >= 0 holds)."""
    A = geometry("dgram").tangent_projection(W, A)
    wa = (W * A).sum(dim=-2)
    fix = capped & (wa < 0)
    return A - W * torch.where(fix, wa / W.square().sum(dim=-2), torch.zeros_like(wa))


def cone_optimum(W, G, capped, iters=3000, tol=1e-9, check_every=50):
    """(optimal <G/|G|, A> / ||A||_op, certified upper bound) over dgram-cap's tangent cone at W
    (tall orientation): `optimum`'s ADMM with the cone's projection."""
    W, G = W.double(), G.double()
    return certified_admm(G, lambda Y: cone_projection(W, Y, capped), iters, tol, check_every)
