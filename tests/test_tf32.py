"""TF32 products (kernels/precision.py) and the solver's TF32 inner iterations (a SolverPlan at
precision tf32: manifolds/plan.py)."""
import math

import pytest
import torch

import kernels
from kernels import products_torch
from kernels.matrix_sign import CLIP_SCHEDULE, EXACT_SCHEDULE
from kernels.precision import round_to_tf32, tf32_active, tf32_products
from manifolds.solver import solve_tall
from manifolds.geometry import geometry
from manifolds.optimum import random_point
from manifolds.plan import EXACT_PE_STEPS, SolverOptions, plan_for


def cpu_plan(**options):
    """The SolverPlan of these SolverOptions for fp32 CPU tensors, on the torch kernels."""
    return plan_for(SolverOptions(**{"backend": "torch", "scheme": "admm", **options}), "cpu")


def tf32_reference(x):
    """x rounded to 11 significant bits (TF32's 10 stored + the implicit one), ties to even,
    computed on Python floats: m in [0.5, 1), x = m 2^e, round(m 2^11) / 2^11 2^e."""
    if x == 0.0:
        return 0.0
    m, e = math.frexp(x)
    return math.ldexp(round(m * 2 ** 11), e - 11)  # round() is ties-to-even


def test_rounding_matches_an_independent_reference():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2000, generator=g) * torch.exp(4 * torch.randn(2000, generator=g))
    # exact ties: 11 significant bits plus a half in the 12th, odd and even kept bits
    ties = torch.tensor([1 + 2 ** -11, 1 + 3 * 2 ** -11, -(1 + 2 ** -11), 2 ** -11 + 2 ** -22, 0.0, 1.0])
    x = torch.cat([x, ties])
    expected = torch.tensor([tf32_reference(v) for v in x.tolist()])
    assert torch.equal(round_to_tf32(x), expected)
    assert round_to_tf32(torch.ones(3, dtype=torch.float64)).dtype == torch.float64  # other dtypes pass


def test_products_read_tf32_operands_only_inside_the_scope():
    g = torch.Generator().manual_seed(1)
    X = torch.randn(4, 48, 96, generator=g)
    exact = (X.double() @ X.double().mT)
    error = lambda S: ((S.double() - exact).norm() / exact.norm()).item()  # noqa: E731
    fp32 = error(products_torch.sym_product(X))
    with tf32_products():
        with tf32_products():
            assert tf32_active()
        assert tf32_active()  # nested scopes unwind one at a time
        tf32 = error(products_torch.sym_product(X))
        rounded = round_to_tf32(X)
        torch.testing.assert_close(products_torch.sym_product(X), rounded @ rounded.mT, rtol=0, atol=0)
    assert not tf32_active()
    assert fp32 < 1e-6 and 1e-5 < tf32 < 1e-3  # 2^-11 relative rounding of each operand


def test_triton_kernels_take_tf32_inside_the_scope():
    pytest.importorskip("triton")
    from kernels.products_triton import fp32_precision
    before = fp32_precision()
    with kernels.tf32_products():
        assert fp32_precision() == "tf32"
    assert fp32_precision() == before


@pytest.mark.parametrize("manifold", ["stiefel", "dgram"])
def test_tf32_iterations_end_in_an_fp32_feasible_direction(manifold):
    W, G = random_point((96, 32), manifold, seed=5)
    W, G = W.float()[None], G.float()[None]
    solve = lambda precision: solve_tall(W, G, geometry(manifold), None, cpu_plan(  # noqa: E731
        precision=precision, clip="polynomial", capturable=True)).A[0]
    A, exact = solve("tf32"), solve("fp32")
    assert geometry(manifold).tangent_residual(W[0].double(), A.double()).abs().max() <= 1e-5
    assert 1 - 2e-3 <= torch.linalg.matrix_norm(A.double(), 2) <= 1 + 1e-3  # A / (a bound on it), as in fp32
    # the iterations did run at TF32 (the answers differ by more than fp32 rounding) and reach
    # the same direction
    gap = ((A - exact).norm() / exact.norm()).item()
    assert 1e-5 < gap < 0.05
    G0 = G[0] / G[0].norm()
    assert (G0 * A).sum() >= 0.99 * (G0 * exact).sum()


def test_square_stiefel_exact_step_at_tf32_is_the_fp32_answer():
    # square Stiefel's exact step W msign(skew(W^T G)) runs its matrix sign at TF32 under tf32
    # iterations (solver.exact_square_stiefel, EXACT_SCHEDULE): fp32-tangent, unit, and the fp32
    # path's objective; a momentum-like gradient has the small singular values the [0.001, 1]
    # schedule is for
    from bench.optimizer import momentum_like
    from manifolds import project_to_manifold
    g = torch.Generator().manual_seed(0)
    W = project_to_manifold(torch.randn(96, 96, generator=g) * 0.02, "stiefel")[None]
    G = momentum_like((96, 96), g)[None]
    solve = lambda precision: solve_tall(W, G, geometry("stiefel"), None, cpu_plan(  # noqa: E731
        precision=precision, capturable=True)).A[0].double()
    A, exact = solve("tf32"), solve("fp32")
    assert geometry("stiefel").tangent_residual(W[0].double(), A).abs().max() <= 1e-6
    # both divided by a bound on their norm (solver.finalize_banks), whose slack differs a little
    # (here 4e-4 in fp32, 7e-4 from the TF32 Gram): the objective is compared per unit norm
    norm, exact_norm = torch.linalg.matrix_norm(A, 2), torch.linalg.matrix_norm(exact, 2)
    assert 1 - 1e-3 <= norm <= 1 + 1e-4 and 1 - 1e-3 <= exact_norm <= 1 + 1e-4
    assert 1e-6 < ((A - exact).norm() / exact.norm()).item()  # it did run at TF32
    G0 = G[0].double()
    assert (G0 * A).sum() / norm >= (1 - 1e-4) * (G0 * exact).sum() / exact_norm  # 5 steps for [0.005, 1]: -2e-4


def record_msign_dtypes(monkeypatch):
    """The dtypes kernels.msign is called with, in order (a list filled as it runs)."""
    seen = []
    msign = kernels.msign
    monkeypatch.setattr(kernels, "msign", lambda X, *a, **k: seen.append(X.dtype) or msign(X, *a, **k))
    return seen


def with_singular_values(s, seed):
    """(U, V, X) with X = U diag(s) V^T (fp32; U, V float64), two 96 x 32 matrices."""
    g = torch.Generator().manual_seed(seed)
    U = torch.linalg.qr(torch.randn(2, 96, s.numel(), generator=g, dtype=torch.float64))[0]
    V = torch.linalg.qr(torch.randn(2, s.numel(), s.numel(), generator=g, dtype=torch.float64))[0]
    return U, V, ((U * s) @ V.mT).float()


def test_admm_starting_polar_factor_runs_in_bf16_under_tf32(monkeypatch):
    # ADMM's starting Z is only a starting point: under tf32 iterations its matrix sign runs in
    # bf16 (solver.polar), stable with the safe minimax schedule, and comes back as fp32
    import manifolds.solver as solver
    seen = record_msign_dtypes(monkeypatch)
    Y = torch.randn(2, 96, 32, generator=torch.Generator().manual_seed(0))
    for precision, dtype in (("tf32", torch.bfloat16), ("fp32", torch.float32)):
        seen.clear()
        Z = solver.polar(Y, cpu_plan(precision=precision, clip="polynomial"))
        assert seen == [dtype] and Z.dtype == torch.float32
        U, _, Vh = torch.linalg.svd(Y.double(), full_matrices=False)
        assert (Z.double() - U @ Vh).abs().max() < (0.05 if dtype == torch.bfloat16 else 1e-4)


def test_spectral_clip_takes_both_signs_in_bf16_under_tf32(monkeypatch):
    # under tf32 iterations the clip's msign(Y) and its q x q sign(P - I) run in bf16 (the
    # pullbacks and the final projection absorb their rounding); the clip still caps Y's
    # singular values at 1, to bf16's accuracy, and keeps those below
    import manifolds.solver as solver
    seen = record_msign_dtypes(monkeypatch)
    s = torch.linspace(0.1, 3.0, 32, dtype=torch.float64)
    U, V, Y = with_singular_values(s, seed=0)
    expected = (U * s.clamp_max(1.0)) @ V.mT
    for precision, dtypes in (("tf32", [torch.bfloat16] * 2), ("fp32", [torch.float32] * 2)):
        seen.clear()
        Z = solver.spectral_clip(Y, cpu_plan(precision=precision, clip="polynomial"))
        assert seen == dtypes and Z.dtype == torch.float32
        assert (Z.double() - expected).abs().max() < (2e-2 if precision == "tf32" else 5e-5)  # 8.7e-3, 7e-6


def test_pull_back_takes_its_sign_in_bf16_under_tf32(monkeypatch):
    # the pullback's q x q sign(B^T B - I) runs in bf16 under tf32 iterations, fp32 otherwise;
    # either way the singular values above 1 come down (s (3 - s^2) / 2) and those below stay
    import manifolds.solver as solver
    seen = record_msign_dtypes(monkeypatch)
    s = torch.linspace(0.1, 1.2, 32, dtype=torch.float64)
    U, V, B = with_singular_values(s, seed=1)
    expected = (U * torch.where(s > 1, s * (3 - s.square()) / 2, s)) @ V.mT
    for precision, dtype, tolerance in (("tf32", torch.bfloat16, 2e-3), ("fp32", torch.float32, 1e-5)):  # 3.4e-4, 2e-7
        seen.clear()
        pulled = solver.pull_back(B, cpu_plan(precision=precision, clip="polynomial"))
        assert seen == [dtype] and pulled.dtype == torch.float32
        assert (pulled.double() - expected).abs().max() < tolerance


def test_auto_precision_is_fp32_on_cpu_tf32_on_cuda():
    # resolved from the device and dtype alone (plan_for touches no tensor, so the CUDA rows
    # hold on a machine without one)
    auto = SolverOptions()
    assert plan_for(auto, "cpu").precision == "fp32"
    assert plan_for(auto, "meta").precision == "fp32"
    assert plan_for(auto, "cuda").precision == "tf32"
    assert plan_for(auto, "cuda", torch.float64).precision == "fp32"
    assert plan_for(auto, "cuda", torch.bfloat16).precision == "bf16"
    assert plan_for(SolverOptions(precision="fp32"), "cuda").precision == "fp32"  # a choice is kept


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
def test_plan_schedules_follow_the_iterations_precision(precision):
    # below fp32 iterations: bf16 matrix signs, one clip step fewer (its last reaches an accuracy
    # such products cannot hold); square Stiefel's exact sign is the minimax EXACT_SCHEDULE at
    # tf32 only, Polar Express and its polish otherwise
    plan = cpu_plan(precision=precision, clip="polynomial")
    full = precision == "fp32"
    assert plan.tf32 == (precision == "tf32")
    assert plan.sign_torch_dtype == (torch.float32 if full else torch.bfloat16)
    assert plan.clip_steps == len(CLIP_SCHEDULE) - (0 if full else 1)
    assert plan.exact_sign == (("minimax", len(EXACT_SCHEDULE)) if precision == "tf32"
                               else ("polar-express", sum(EXACT_PE_STEPS)))


def test_clip_runs_the_plans_step_count(monkeypatch):
    # the clip's two signs run plan.clip_steps steps: the plan, not a global, decides it
    import manifolds.solver as solver
    steps = []
    msign = kernels.msign
    monkeypatch.setattr(kernels, "msign", lambda X, n, *a, **k: steps.append(n) or msign(X, n, *a, **k))
    Y = torch.randn(2, 96, 32, generator=torch.Generator().manual_seed(0))
    for precision in ("fp32", "tf32"):
        steps.clear()
        plan = cpu_plan(precision=precision, clip="polynomial")
        solver.spectral_clip(Y, plan)
        assert steps == [plan.clip_steps] * 2


@pytest.mark.parametrize("manifold", ["stiefel", "dgram"])
@pytest.mark.parametrize("eta", [0.02, 0.2])
def test_retraction_with_tf32_corrections_lands_as_close_to_the_manifold_as_fp32(manifold, eta):
    # the retraction after a step: its Gram in fp32, the Newton-Schulz corrections (S - I) X at
    # TF32; the violation and the point must be the fp32 ones, where an all-TF32 iteration
    # would stop ~1e-4 away from the manifold
    W, G = random_point((192, 48), manifold, seed=7)
    geo = geometry(manifold)
    A = solve_tall(W[None], G[None], geo, None, cpu_plan()).A
    X = W[None] - eta * A
    fp32 = geo.retract(X, backend="torch")
    mixed = geo.retract(X, backend="torch", tf32_correction=True)
    with tf32_products():
        all_tf32 = geo.retract(X, backend="torch")
    violation = lambda Y: float(geo.violation(Y.double()).max())  # noqa: E731
    assert violation(mixed) <= 2 * violation(fp32) + 1e-6 < 1e-5 < violation(all_tf32)
    assert (mixed - fp32).abs().max() <= 1e-5 < (all_tf32 - fp32).abs().max()


@pytest.mark.parametrize("manifold", ["stiefel", "dgram"])
def test_projection_with_a_tf32_correction_is_as_tangent_as_fp32(manifold):
    # finalize's projection of an answer that is tangent up to a small residual (a solver's
    # rounding or tolerance): W M at TF32, the Gram that measures the residual in fp32. The
    # residual left is ~5e-4 of the one before, below fp32's own rounding here; an all-TF32
    # projection leaves 100x more.
    W, G = random_point((192, 48), manifold, seed=8)
    geo = geometry(manifold)
    normal = W @ torch.randn(48, 48, generator=torch.Generator().manual_seed(0))
    A = geo.tangent_projection(W.double(), G.double()).float() + 1e-5 * normal
    residual = lambda X: float(geo.tangent_residual(W.double(), X.double()).abs().max())  # noqa: E731
    fp32 = geo.tangent_projection(W, A, backend="torch")
    mixed = geo.tangent_projection(W, A, backend="torch", tf32_correction=True)
    with tf32_products():
        all_tf32 = geo.tangent_projection(W, A, backend="torch")
    assert residual(A) > 20 * residual(fp32)
    assert residual(mixed) <= 1.1 * residual(fp32) and 100 * residual(fp32) < residual(all_tf32)


@pytest.mark.parametrize("kind", ["flat", "spread", "lone"])
def test_norm_bound_squarings_in_bf16_under_a_tf32_plan_stay_an_upper_bound(kind, monkeypatch):
    """finalize_banks' bound under a TF32 plan runs its squarings from S^16 on in bf16
    (late_dtype, norm_bound.LATE_FROM): it stays within [1 - 3e-4, 1 + 3e-3] of lam_1 (the float64
    eigenvalue) on a flat top (an msign's Gram), a spread spectrum and a lone top, as the TF32
    squarings do, and the squarings do run in bf16 (7 of the 10 products)."""
    import kernels
    import manifolds.norm_bound as norm_bound
    g = torch.Generator().manual_seed(3)
    q = 96
    U, _ = torch.linalg.qr(torch.randn(2 * q, q, generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(q, q, generator=g, dtype=torch.float64))
    s = {"flat": 1 - 1e-3 * torch.rand(q, generator=g, dtype=torch.float64),
         "spread": torch.rand(q, generator=g, dtype=torch.float64) ** 0.3,
         "lone": torch.cat([torch.ones(1, dtype=torch.float64),
                            0.5 * torch.rand(q - 1, generator=g, dtype=torch.float64)])}[kind]
    A = (U * s) @ V.T
    lam = float(s.max() ** 2)
    S = (A.mT @ A).float()[None]
    dtypes = []
    sym_product = kernels.sym_product
    monkeypatch.setattr(kernels, "sym_product", lambda X, *a, **k: dtypes.append(X.dtype) or sym_product(X, *a, **k))
    with kernels.tf32_products(True):
        bound = float(norm_bound.top_eigenvalue_bound(S, 10, "torch", tf32=True, late_dtype=torch.bfloat16))
        reference = float(norm_bound.top_eigenvalue_bound(S, 10, "torch", tf32=True))
    assert dtypes.count(torch.bfloat16) == 10 - norm_bound.LATE_FROM
    assert 1 - 3e-4 <= bound / lam <= 1 + 3e-3, (kind, bound / lam - 1)
    # lam is ||A||_op^2: 6e-4 here is 3e-4 of the norm (measured 3.8e-4 on the flat top)
    assert abs(bound / reference - 1) < 6e-4, (kind, bound / reference - 1)


def test_sharpen_lifts_with_a_bf16_product_under_a_tf32_plan_and_keeps_the_direction(monkeypatch):
    """Under a TF32 plan with bf16 signs the online answer's lift A R1 (solver.FullProblem.sharpened)
    reads bf16 operands (A's values are bf16 already; R1 rounded): the answer is within 2e-3
    (relative, Frobenius) of the one with TF32 operands, and as tangent."""
    import manifolds.solver as solver_module
    from kernels.precision import bf16_active
    plan = plan_for(SolverOptions(capturable=True, precision="tf32", clip="polynomial"), "cpu")
    W, G = (x[None] for x in random_point((96, 32), "dgram", 5))
    seen = []
    matmul_add = kernels.matmul_add
    monkeypatch.setattr(kernels, "matmul_add", lambda B, X, C, *a, **k: seen.append(bf16_active()) or
                        matmul_add(B, X, C, *a, **k))
    low = solve_tall(W, G, geometry("dgram"), None, plan).A
    assert any(seen)
    original = solver_module.FullProblem.sharpened
    monkeypatch.setattr(solver_module.FullProblem, "sharpened",
                        lambda self, A, S, M, low=False: original(self, A, S, M))
    high = solve_tall(W, G, geometry("dgram"), None, plan).A
    assert 0 < float((low - high).norm() / high.norm()) < 2e-3
    residual = lambda A: float(geometry("dgram").tangent_residual(W, A).abs().max())  # noqa: E731
    # the exact projection by W runs at TF32 either way: the same residual to its rounding
    assert residual(low) <= 1.5 * residual(high) + 1e-6, (residual(low), residual(high))


def test_online_x_reads_bf16_operands_where_the_sign_reads_bf16(monkeypatch):
    """solver.online_iterations forms X = G + W (2C - M0) with bf16 operands where its matrix sign
    reads X in bf16 anyway (sign_reads_bf16: polynomial signs under a TF32 plan); the CPU's fp32
    plan and the eigh clip keep fp32 operands. The direction's quality (a fraction of the float64
    optimum) is that of TF32 operands to 2e-3 (measured: within 1e-3 either way, bf16 signs'
    own noise), and the answer as tangent."""
    import manifolds.solver as solver_module
    from kernels.precision import bf16_active
    from manifolds.optimum import optimum, quality
    gpu = plan_for(SolverOptions(capturable=True, precision="tf32", clip="polynomial"), "cpu")
    assert solver_module.sign_reads_bf16(gpu)
    assert not solver_module.sign_reads_bf16(plan_for(SolverOptions(), "cpu"))
    assert not solver_module.sign_reads_bf16(plan_for(SolverOptions(precision="tf32", clip="eigh"), "cpu"))
    scopes = []
    times_W = solver_module.FullProblem.times_W
    monkeypatch.setattr(solver_module.FullProblem, "times_W",
                        lambda self, *a: scopes.append(bf16_active()) or times_W(self, *a))
    reads_bf16 = solver_module.sign_reads_bf16
    for manifold, seed in (("stiefel", 6), ("dgram", 7)):
        W, G = random_point((96, 32), manifold, seed)
        best, _ = optimum(W.double(), G.double(), manifold, iters=2000)
        answers = []
        for low in (True, False):
            monkeypatch.setattr(solver_module, "sign_reads_bf16", reads_bf16 if low else lambda plan: False)
            scopes.clear()
            answers.append(solve_tall(W[None], G[None], geometry(manifold), None, gpu).A[0])
            assert scopes and all(scope == low for scope in scopes)  # the 4 cold dual steps' X
        score = [quality(W.double(), G.double(), A.double(), best) for A in answers]
        assert score[0] >= score[1] - 2e-3, (manifold, score)
        residual = lambda A: float(geometry(manifold).tangent_residual(W[None], A[None]).abs().max())  # noqa: E731
        assert residual(answers[0]) <= 1.5 * residual(answers[1]) + 1e-6
