"""What one optimizer step computes for one matrix, term by term, in multiply-adds.

`matrix_work` is the one description of the solver's work: rank balancing
(`balanced_owners`, through `piece_cost`) splits the pieces by its total, and the
benchmarks' FLOP model (bench/optimizer.py) sums it over a model's matrices. Only its ratios
between matrices have to be right for the balancing; bench/cost_model.py counts the real ops of
a step, which is what a GPU estimate uses.

Terms follow manifolds/solver.py on the tall orientation p x q (p >= q); one polynomial matrix-sign
step on the q x p orientation is S = X X^T, S^2, B X: 2 p q^2 + q^3. Early exits on convergence
are ignored (a warm step of the sync-free mode runs its whole budget); the online scheme's warm
step is one dual step (solver.online_iterations; geo.online_steps of them). dgram-cap is costed as
dgram: its active-set rounds run only with columns at the cap; Oblique runs ADMM on the full
matrices (its Gram is not diagonal). Integers, so that ties in the
balancing are exact on every rank.
"""
from kernels.matrix_sign import CLIP_SCHEDULE, POLAR_SCHEDULE
from manifolds.solver import online_sign_steps, sharpens
from manifolds.geometry import geometry
from manifolds.newton import CG_STEPS, NEWTON_WARM
from manifolds.plan import EXACT_PE_STEPS, MUON_STEPS, NORM_SQUARINGS


def sign_work(rows, q, steps):
    return steps * (2 * rows * q * q + q ** 3)


def matrix_work(manifold, p, q, plan):
    """{term: multiply-adds} of one warm step of a p x q matrix (p >= q) on `manifold`."""
    muon_steps = sum(MUON_STEPS)
    geo = geometry(manifold)
    if not geo.constrained:
        return {"msign": sign_work(p, q, muon_steps)}
    # three Newton-Schulz steps, or a scaling (Oblique's columns, the Hyperball's norm)
    retraction = sign_work(p, q, 3) if geo.polar_retraction else p * q
    if geo.exact_square_step and p == q:
        return {"multiplier": 3 * p * q * q + q ** 3, "msign": sign_work(p, q, sum(EXACT_PE_STEPS)),
                "polish": 2 * p * q * q + sign_work(p, q, 2), "projection and norm": 3 * p * q * q + 5 * q ** 3,
                "retraction": retraction}
    if plan.options.scheme == "newton" and not geo.secant_dual:
        return newton_work(geo, p, q, retraction)
    if plan.options.scheme in ("online", "newton"):  # newton runs the online dual where it has a secant one
        # Proj_T(G) + 2 W C (W^T G, one product with W), one polar factor, M (W^T A), A - W M
        work = {"dual step": 4 * p * q * q * geo.online_steps,
                "msign": sign_work(p, q, online_sign_steps(geo, plan)) * geo.online_steps,
                "norm": p * q * q + NORM_SQUARINGS * q ** 3, "retraction": retraction}
        if sharpens(geo, plan):
            work["sharpen"] = p * q * q + 4 * q ** 3  # A R1 and four q x q products (solver.FullProblem.sharpened)
        return work
    iterations = plan.options.iterations * (2 if p < 2 * q else 1)
    reduced = geo.orthogonal_columns and p >= 2 * q  # ADMM in span[W, G]: on 2q x q problems
    n = 2 * q if reduced else p
    projection = 2 * q * q if reduced else 2 * p * q * q
    if plan.clip == "eigh":
        clip = 2 * n * q * q + 10 * q ** 3
    else:
        clip = 2 * sign_work(n, q, len(CLIP_SCHEDULE)) + 2 * n * q * q
    work = {"iterations": iterations * (projection + clip)}
    if reduced:  # K = V^T V and the lift (6 p q^2); the lifted answer needs only its norm
        work.update({"reduction and lift": 6 * p * q * q, "norm": p * q * q + 5 * q ** 3})
    else:
        work["projection and norm"] = 3 * p * q * q + 5 * q ** 3
    work["retraction"] = retraction
    return work


def newton_work(geo, p, q, retraction):
    """{term: multiply-adds} of scheme=newton's warm step (manifolds/newton.py): the tall products
    W^T G and G^T G (and W^T W where the Gram is not diagonal), then q x q work only. A Newton
    step forms Y (3 products), N = Y^(-1/2) by the L-step polar iteration on the Gram (4 products a
    step, 2 in the last), F (1) and CG_STEPS Jacobian products (K^T V, dN's recursion 6 a step
    less 4, two outer products: 6 L - 1); the answer repeats Y, N and F, then Lambda N and the two
    tall products G N and W (...). Against bench.op_count's count of a warm solve (p x 64, DGram,
    p = 96, 192, 256): 375.5 / 383.0 / 388.0 q^3 without the retraction against 374.5 / 382.8 /
    388.2 counted, where the ADMM terms used before gave 297.5 / 209.1 / 222.1 with it."""
    L = len(POLAR_SCHEDULE)
    inverse_sqrt = (4 * L - 2) * q ** 3
    step = 3 * q ** 3 + inverse_sqrt + q ** 3 + CG_STEPS * (6 * L - 1) * q ** 3
    return {"gram products": (2 if geo.orthogonal_columns else 3) * p * q * q,
            "newton steps": NEWTON_WARM * step,
            "answer": 4 * q ** 3 + inverse_sqrt + 2 * p * q * q,
            "norm": p * q * q + NORM_SQUARINGS * q ** 3, "retraction": retraction}


def piece_cost(piece, plan):
    """Estimated cost of one warm step of an optimizer piece (total of matrix_work)."""
    rows, cols = piece.hi - piece.lo, piece.param.size(1)
    return sum(matrix_work(piece.manifold, max(rows, cols), min(rows, cols), plan).values())


def balanced_owners(costs, world_size):
    """The rank that computes each of these pieces (costs in the optimizer's piece order):
    longest processing time first, each piece onto the least loaded rank (ties: the lowest
    rank), pieces in order of decreasing cost (ties: the earlier piece). Deterministic, so every
    rank computes the same assignment without communicating."""
    loads = [0] * world_size
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        owners[i] = rank
        loads[rank] += costs[i]
    return owners
