"""The kernels: matrix sign against exact SVD, and the Triton backend against its torch twin.

On a CPU the Triton kernels run in the Triton interpreter (conftest sets TRITON_INTERPRET=1);
on a GPU machine they are compiled and run on CUDA tensors. Shapes are chosen so that no
dimension is a multiple of the 32-wide tiles small problems use, and most span several tiles.
"""
import os
import subprocess
import sys

import pytest
import torch
import triton

import kernels
from kernels import BackendError, msign, orthonormalize_near, products_torch, products_triton
from manifolds.geometry import MANIFOLDS

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def polar(X):
    U, _, Vh = torch.linalg.svd(X.double(), full_matrices=False)
    return U @ Vh


def randn(*shape, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator).to(device=DEVICE, dtype=dtype)


def symmetric(*shape, seed=0):
    S = randn(*shape, seed=seed)
    return S + S.mT


def max_error(a, b):
    return float((a.double() - b.double()).abs().max())


# --- the iterations (torch backend) against exact SVD -------------------------------------

@pytest.mark.parametrize("shape", [(32, 96), (96, 32), (4, 20, 50)])
def test_msign_matches_polar_factor_after_polish(shape):
    torch.manual_seed(0)
    X = torch.randn(shape)
    out = msign(X, steps=5, polish_steps=3)
    assert out.shape == X.shape
    # well-conditioned rectangular inputs: the polished iteration is fp32-accurate
    assert (out.double() - polar(X)).abs().max() < 1e-4


def test_polar_express_band_and_polish_to_one():
    torch.manual_seed(1)
    X = torch.randn(48, 128)
    raw = torch.linalg.svdvals(msign(X, steps=5).double())
    assert 0.7 < raw.min() and raw.max() < 1.2  # Polar Express: a band around 1
    polished = torch.linalg.svdvals(msign(X, steps=5, polish_steps=2).double())
    assert (polished - 1).abs().max() < 2e-3


def test_msign_is_scale_invariant_and_maps_zero_to_zero():
    torch.manual_seed(2)
    X = torch.randn(16, 40)
    assert torch.allclose(msign(X, polish_steps=2), msign(1e3 * X, polish_steps=2), atol=1e-5)
    assert torch.count_nonzero(msign(torch.zeros(8, 8))) == 0


def test_normalisation_bounds_the_top_singular_value_tighter_than_frobenius():
    # ||S||_F^(1/2) >= s_1 always (a normalised X has s_1 <= 1); for a flat spectrum it is
    # n^(1/4) s_1 where the Frobenius norm is n^(1/2) s_1: the small singular values start higher
    torch.manual_seed(5)
    for X in (torch.randn(64, 256), torch.linalg.qr(torch.randn(256, 64))[0].T,  # random, flat
              torch.diag(torch.tensor([1e3, 1.0, 1e-3])) @ torch.randn(3, 9)):  # one dominant value
        Xn, S = kernels.matrix_sign.normalized(X, products_torch)
        s, original = torch.linalg.svdvals(Xn.double()), torch.linalg.svdvals(X.double())
        assert s.max() <= 1.0 and s.max() >= 1 / (1.01 * X.size(0) ** 0.25) - 1e-6
        assert torch.allclose(s / s.max(), original / original.max(), rtol=1e-3, atol=1e-9)  # a scaling
        assert torch.allclose(S, Xn @ Xn.T, atol=1e-6)
        # never looser than the Frobenius normalisation (both with 1% of safety)
        assert s.max() >= original.max() / (1.01 * X.double().norm()) - 1e-9
    flat = torch.linalg.svdvals(kernels.matrix_sign.normalized(torch.linalg.qr(torch.randn(256, 64))[0].T,
                                                               products_torch)[0].double())
    assert flat.min() > 0.35 > 64 ** -0.5  # 64^(-1/4) / 1.01 = 0.35 where the Frobenius norm gives 0.125


FP32_AT_ONE = 6e-8  # half of fp32's spacing at 1


def test_clip_schedule_lands_within_fp32_of_one_and_lifts_what_lies_below():
    ms = kernels.matrix_sign
    # composing the polynomials on a dense grid of [0.02, 1] in float64: the claim itself, and
    # what a singular value below the range still reaches
    x = torch.linspace(ms.CLIP_LOWER, 1.0, 200001, dtype=torch.float64)
    below = torch.tensor([0.01], dtype=torch.float64)
    for a, b, c in ms.CLIP_SCHEDULE:
        x, below = (a * t + b * t ** 3 + c * t ** 5 for t in (x, below))
    assert float((x - 1).abs().max()) < FP32_AT_ONE
    assert 0.98 < float(below) < 1.0
    # and on matrices: singular values spread over a factor 20 reach the polar factor in five
    # steps, where five Polar Express steps without polish do not
    g = torch.Generator().manual_seed(6)
    U = torch.linalg.qr(torch.randn(96, 32, generator=g, dtype=torch.float64))[0]
    V = torch.linalg.qr(torch.randn(32, 32, generator=g, dtype=torch.float64))[0]
    X = ((U * torch.linspace(1.0, 20.0, 32, dtype=torch.float64)) @ V.T).float()
    out = msign(X, steps=5, schedule=ms.CLIP_SCHEDULE)
    assert (out.double() - U @ V.T).abs().max() < 1e-5
    assert (msign(X, steps=5).double() - U @ V.T).abs().max() > 1e-2


SCHEDULES = [("CLIP_SCHEDULE", "CLIP_LOWER"), ("POLAR_SCHEDULE", "POLAR_LOWER"), ("EXACT_SCHEDULE", "EXACT_LOWER")]


@pytest.mark.parametrize("name, lower", SCHEDULES)
def test_minimax_schedules_are_computed_and_land_in_fp32_at_the_end(name, lower):
    ms = kernels.matrix_sign
    schedule, lower = getattr(ms, name), getattr(ms, lower)
    computed, errors = ms.minimax_schedule(lower, len(schedule), ms.SCHEDULE_SAFETY)
    for ours, theirs in zip(schedule, computed):
        assert ours == pytest.approx(theirs, abs=1e-9)
    x = torch.linspace(lower, 1.0, 200001, dtype=torch.float64)
    for a, b, c in schedule:
        x = a * x + b * x ** 3 + c * x ** 5
    assert float((x - 1).abs().max()) < FP32_AT_ONE and errors[-1] < FP32_AT_ONE


def test_clip_schedule_lands_in_tf32_rounding_one_step_early():
    """Below fp32 the plan drops the clip's last step (plan.clip_steps; ADMM's polar start runs
    all of POLAR_SCHEDULE at every precision): the step before must already leave the clip's
    range within ~5e-4 of 1 (TF32's unit rounding 2^-11 = 4.9e-4)."""
    from manifolds.plan import SolverOptions, plan_for
    ms = kernels.matrix_sign
    schedule = ms.CLIP_SCHEDULE
    for precision, clip_steps in (("fp32", len(schedule)), ("tf32", len(schedule) - 1), ("bf16", len(schedule) - 1)):
        plan = plan_for(SolverOptions(precision=precision, clip="polynomial"), "cpu")
        assert (plan.clip_steps, plan.polar_steps) == (clip_steps, len(ms.POLAR_SCHEDULE)), precision
    x = torch.linspace(ms.CLIP_LOWER, 1.0, 200001, dtype=torch.float64)
    distances = []
    for a, b, c in schedule:
        x = a * x + b * x ** 3 + c * x ** 5
        distances.append(float((x - 1).abs().max()))
    assert distances[-2] < 2 ** -10 < distances[-3]  # one step short lands at TF32, two short do not


def tf32_top_singular_value(schedule, steps, seeds):
    """The largest singular value msign leaves, at TF32, over random inputs: flat spectra (their
    many top singular values sit at the end of each step's interval) and spiky ones."""
    top = 0.0
    for seed in seeds:
        g = torch.Generator().manual_seed(seed)
        Y = torch.randn((96, 32) if seed % 2 else (64, 64), generator=g)
        if seed % 3 == 0:
            U, _, Vh = torch.linalg.svd(Y, full_matrices=False)
            Y = (U * torch.logspace(0, -2.5, Vh.size(0))) @ Vh
        with kernels.tf32_products():
            Z = msign(Y, steps=steps, schedule=schedule, backend="torch")
        top = max(top, torch.linalg.matrix_norm(Z.double(), 2).item())
    return top


def test_minimax_schedules_stay_stable_at_tf32():
    # as they run under tf32 iterations: the clip's signs one step short (plan.clip_steps), the polar
    # factor all 6 (solver.polar), square Stiefel's exact step all 7 (solver.exact_square_stiefel)
    ms = kernels.matrix_sign
    seeds = range(24)
    for schedule, steps in ((ms.CLIP_SCHEDULE, 4), (ms.POLAR_SCHEDULE, 6), (ms.EXACT_SCHEDULE, 7)):
        assert tf32_top_singular_value(schedule, steps, seeds) < 1.002
    # the same [0.001, 1] schedule without the safety margin blows up on some of these inputs
    unsafe, _ = ms.minimax_schedule(ms.EXACT_LOWER, 7)
    assert tf32_top_singular_value(unsafe, 7, seeds) > 2.0


def test_orthonormalize_near_converges_quadratically():
    torch.manual_seed(3)
    Q = polar(torch.randn(64, 16)).float()
    X = Q + 1e-2 * torch.randn(64, 16)
    for steps, bound in ((1, 1e-2), (2, 1e-4), (3, 1e-5)):  # error squares each step
        out = orthonormalize_near(X, steps=steps).double()
        assert (out.T @ out - torch.eye(16, dtype=torch.float64)).abs().max() < bound
    assert (orthonormalize_near(X, steps=3).double() - polar(X)).abs().max() < 1e-5


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_orthonormalize_near_in_gram_space_takes_the_newton_schulz_steps(backend):
    # Tall banks (rows >= 2 cols) run all steps but the last on q x q (matrix_sign._gram_steps):
    # the same iterates as Newton-Schulz on X itself, computed here in float64 as the reference,
    # and as orthonormal, with or without TF32 operands in the Gram-space steps
    Q = polar(randn(2, 96, 32).double())
    X = (Q + 0.006 * randn(2, 96, 32, seed=1).double()).float()  # ||X^T X - I||_op ~ 0.1
    for steps in (2, 3):
        reference = X.double()
        for _ in range(steps):
            reference = 1.5 * reference - 0.5 * reference @ (reference.mT @ reference)
        for tf32 in (False, True):
            out = orthonormalize_near(X, steps=steps, backend=backend, tf32_correction=tf32).double()
            # TF32 operands leave ~5e-4 of the first correction as a small rotation (2e-6 here);
            # a Gram-space step 10% short of -E/2 would leave 1e-5 at two steps
            assert max_error(out, reference) < (5e-6 if tf32 else 5e-7)
            if steps == 3:  # converged, to fp32 whatever the Gram-space steps' precision
                gram = out.mT @ out
                assert max_error(gram, torch.eye(32, dtype=torch.float64, device=gram.device).expand_as(gram)) < 2e-6


def test_orthonormalize_near_stays_stable_far_from_the_manifold():
    torch.manual_seed(4)
    X = 5.0 * torch.randn(40, 10)  # singular values far above sqrt(3): plain Newton-Schulz diverges
    out = orthonormalize_near(X, steps=12).double()
    assert torch.isfinite(out).all()
    assert (out.T @ out - torch.eye(10, dtype=torch.float64)).abs().max() < 1e-3


# --- Triton matrix sign against the torch twin --------------------------------------------

MSIGN_SHAPES = [(3, 40, 72), (2, 72, 40), (50, 50)]  # wide batch, tall batch, one square matrix


@pytest.mark.parametrize("shape", MSIGN_SHAPES)
def test_triton_msign_agrees_with_torch_in_fp32(shape):
    X = randn(*shape)
    fused = msign(X, steps=5, polish_steps=2, backend="triton")
    assert fused.shape == X.shape and fused.dtype == X.dtype
    assert max_error(fused, msign(X, steps=5, polish_steps=2, backend="torch")) < 1e-4
    if shape[-1] != shape[-2]:  # and the polar factor (random square matrices are ill-conditioned)
        assert max_error(fused, polar(X)) < 1e-3


@pytest.mark.parametrize("shape", MSIGN_SHAPES)
def test_triton_msign_in_bf16_is_as_accurate_as_torch(shape):
    # bf16 results differ by rounding, so both are measured against the float64 run of the
    # same iteration from the same bf16 input: the fused kernels (fp32 epilogues, one rounding
    # per product) must be about as close to it as the torch twin is.
    X = randn(*shape, dtype=torch.bfloat16)
    exact = msign(X.double(), steps=5, backend="torch")
    fused = msign(X, steps=5, backend="triton")
    assert fused.dtype == torch.bfloat16
    error_fused = max_error(fused, exact)
    error_torch = max_error(msign(X, steps=5, backend="torch"), exact)
    assert error_fused < 0.06 and error_fused < 2 * error_torch


def test_triton_orthonormalize_near_agrees_with_torch():
    Q = polar(randn(2, 72, 40)).float()
    X = Q + 1e-2 * randn(2, 72, 40, seed=1)
    fused = orthonormalize_near(X, steps=3, backend="triton")
    assert max_error(fused, orthonormalize_near(X, steps=3, backend="torch")) < 1e-5
    gram = fused.mT @ fused
    assert max_error(gram, torch.eye(40, device=DEVICE).expand_as(gram)) < 1e-4


# --- the products: structure and agreement ------------------------------------------------

def test_sym_product_computes_upper_tiles_and_mirrors_them():
    # 70 rows = three tile rows of 32. Garbage in the lower tile (2, 0) of C, which a kernel
    # that computes only upper tiles and mirrors them never reads, must not reach the output.
    X, C = randn(2, 70, 45), symmetric(2, 70, 70, seed=1)
    garbage = C.clone()
    garbage[:, 64:, :32] = float("nan")
    out = products_triton.sym_product(X, alpha=0.5, C=garbage, beta=2.0)
    assert torch.equal(out, out.mT)  # exactly symmetric
    assert max_error(out, products_torch.sym_product(X, alpha=0.5, C=C, beta=2.0)) < 1e-4


# bf16: one unit in the last place (the interpreter truncates to bf16, the GPU rounds to nearest)
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 2 ** -7)])
def test_matmul_add_agrees_on_transposed_views(dtype, tol):
    B, X, C = randn(3, 45, 70, dtype=dtype), randn(3, 50, 70, dtype=dtype), randn(3, 50, 45, dtype=dtype)
    fused = products_triton.matmul_add(B, X.mT, C.mT, alpha=-0.5, beta=1.5)  # strided operands
    expected = products_torch.matmul_add(B.float(), X.mT.float(), C.mT.float(), alpha=-0.5, beta=1.5)
    assert fused.dtype == dtype
    assert max_error(fused, expected) < tol * float(expected.abs().max())  # relative to the largest entry


def test_bf16_products_read_fp32_operands_as_bf16_in_both_backends():
    """kernels.precision.bf16_products(): fp32 B, X and C, the operands of the product read as
    bf16 and their products summed in fp32, the result fp32. The torch twin rounds to nearest even
    (as a GPU's conversion does); the Triton interpreter's conversion truncates: each backend
    matches its rounding to fp32 accumulation order, and neither is the fp32 product."""
    from kernels.precision import bf16_products
    B, X, C = randn(3, 45, 70), randn(3, 70, 50), randn(3, 45, 50)
    truncate = lambda T: (T.contiguous().view(torch.int32) & ~0xFFFF).view(torch.float32)  # noqa: E731
    nearest = lambda T: T.bfloat16().float()  # noqa: E731
    product = lambda f: 1.5 * C.double() - 0.5 * (f(B).double() @ f(X).double())  # noqa: E731
    with bf16_products():
        fused = products_triton.matmul_add(B, X, C, alpha=-0.5, beta=1.5)
        twin = products_torch.matmul_add(B, X, C, alpha=-0.5, beta=1.5)
        gram = products_triton.sym_product(B)
    scale = float(product(nearest).abs().max())
    assert fused.dtype == twin.dtype == gram.dtype == torch.float32
    assert max_error(twin.double(), product(nearest)) < 1e-6 * scale
    fused_rounding = truncate if products_triton.INTERPRETED else nearest
    assert max_error(fused.double(), product(fused_rounding)) < 1e-6 * scale
    assert max_error(gram.double(), fused_rounding(B).double() @ fused_rounding(B).double().mT) < 1e-6 * float(
        (B @ B.mT).abs().max())
    exact = 1.5 * C.double() - 0.5 * (B.double() @ X.double())
    assert max_error(twin.double(), exact) > 1e-5 * scale  # the operands were rounded: not fp32


def test_plain_matmul_reads_its_stride_zero_c_as_zero_in_both_backends():
    """kernels.matmul (the span Gram's W^T G, the lift V c): matmul_add with beta = 0 and a
    stride-0 zero C, batched and on a transposed view, as the span reduction calls it."""
    V, c = randn(2, 3, 90, 40), randn(2, 3, 40, 20)
    for backend in ("triton", "torch"):
        lifted = kernels.matmul(V, c, backend=backend)
        assert lifted.shape == (2, 3, 90, 20)
        assert max_error(lifted, V @ c) < 1e-5 * float((V @ c).abs().max())
        WtG = kernels.matmul(V[..., :20].mT, V[..., 20:], backend=backend)
        assert max_error(WtG, V[..., :20].mT @ V[..., 20:]) < 1e-5 * float(WtG.abs().max())


TANGENT_CASES = [("stiefel", (3, 70, 40)), ("dgram", (3, 70, 40)), ("dgram", (45, 33))]


def on_manifold(shape, manifold, dtype):
    W = MANIFOLDS[manifold].retract(randn(*shape).double() * torch.linspace(0.5, 2.0, shape[-1]).to(DEVICE),
                                    near=False)
    return W.to(dtype)


@pytest.mark.parametrize("manifold, shape", TANGENT_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_tangent_ops_agree_with_torch(manifold, shape, dtype):
    geo = MANIFOLDS[manifold]
    W, A = on_manifold(shape, manifold, dtype), randn(*shape, dtype=dtype, seed=1)
    rel = 1e-5 if dtype == torch.float32 else 2e-2  # relative to the largest entry
    # H = P(W^T A + A^T W) with P as geometry defines it, and ||H||^2, in float64
    W64, A64 = W.double(), A.double()
    H64 = geo.gram_projector(W64.mT @ A64 + A64.mT @ W64)
    H, sumsq = kernels.tangent_residual(W, A, manifold, backend="triton", with_norm=True)
    assert H.dtype == dtype and torch.equal(H, H.mT)
    assert max_error(H, H64) <= rel * float(H64.abs().max())
    sumsq_rtol = 1e-5 if dtype == torch.float32 else 1e-2
    assert torch.allclose(sumsq.double(), H64.square().sum(dim=(-2, -1)), rtol=sumsq_rtol)
    # A - W H / (d_i^2 + d_j^2), from the same d2 for both backends
    d2 = geo.squared_norms(W.float())
    projected = kernels.tangent_projection(W, A, manifold, d2, backend="triton")
    expected = kernels.tangent_projection(W.float(), A.float(), manifold, d2, backend="torch")
    assert max_error(projected, expected) <= rel * float(expected.abs().max())


@pytest.mark.parametrize("manifold, shape", TANGENT_CASES[:2])
def test_fused_multiplier_and_symmetric_part_match_their_formulas(manifold, shape):
    W = on_manifold(shape, manifold, torch.float32)
    G, A = randn(*shape, seed=1), randn(*shape, seed=2)
    d2 = MANIFOLDS[manifold].squared_norms(W)
    Lambda = kernels.preconditioned(W, G, manifold, d2, alpha=-0.5, backend="triton")
    M = kernels.symmetric_part(A, G, backend="triton")
    pair = MANIFOLDS[manifold].pair_scale(W)  # (d_i^2 + d_j^2)
    # Lambda0 = -P(W^T G + G^T W) / (2 pair), M = sym(A^T G)
    for got, want in ((Lambda, -MANIFOLDS[manifold].gram_projector(W.mT @ G + G.mT @ W) / (2 * pair)),
                      (M, 0.5 * (A.mT @ G + G.mT @ A))):
        assert max_error(got, want) < 1e-5 * float(want.abs().max())


@pytest.mark.parametrize("manifold, shape", [("stiefel", (40, 40)),  # square Stiefel's exact step
                                            ("dgram", (72, 40))])  # ADMM on the full matrices
def test_solver_on_triton_kernels_matches_torch(manifold, shape):
    from manifolds import steepest_direction
    W = on_manifold(shape, manifold, torch.float32)
    G = randn(*shape, seed=1)
    opts = dict(iterations=2, clip="polynomial")  # the same products
    fused = steepest_direction(W, G, manifold, backend="triton", **opts)
    assert max_error(fused, steepest_direction(W, G, manifold, backend="torch", **opts)) < 1e-4


@pytest.mark.skipif(DEVICE != "cuda", reason="autotuned GPU configurations (the interpreter has one)")
@pytest.mark.parametrize("dtype, rel", [(torch.float32, 1e-4), (torch.bfloat16, 0.1)])
def test_autotuned_gpu_kernels_agree_with_torch(dtype, rel):
    # Problems of 256 and more rows use the autotuned 64/128-wide tiles; 384 x 640 shares the
    # compiled specialisations (dimensions divisible by 16) with the GPT-2 banks of the bench.
    X = randn(2, 384, 640, dtype=dtype)
    for Y in (X, X.mT):  # wide and tall
        fused, reference = msign(Y, 5, 2, backend="triton"), msign(Y, 5, 2, backend="torch")
        assert max_error(fused, reference) <= rel * float(reference.abs().max())
    W, A = on_manifold((2, 640, 384), "dgram", dtype), randn(2, 640, 384, dtype=dtype, seed=1)
    d2 = MANIFOLDS["dgram"].squared_norms(W.float()).to(dtype)
    for op in (kernels.tangent_projection, kernels.preconditioned):
        fused, reference = op(W, A, "dgram", d2, backend="triton"), op(W, A, "dgram", d2, backend="torch")
        assert max_error(fused, reference) <= rel / 5 * float(reference.abs().max())


def tuned_symmetric_gram(monkeypatch, do_bench):
    """([tile widths the autotuner's trials ran], tuner): symmetric_gram autotuned between tiles of 32
    and 64 with this benchmark, for every problem size, from an empty choice cache."""
    ran = []
    record = lambda nargs: ran.append(nargs["BLOCK"])  # noqa: E731
    configs = [triton.Config({"BLOCK": 32, "BLOCK_K": 32}, pre_hook=record),
               triton.Config({"BLOCK": 64, "BLOCK_K": 32}, pre_hook=record)]
    timed = lambda kernel_call, quantiles: do_bench(ran, kernel_call, quantiles)  # noqa: E731
    tuner = products_triton.make_tuner("symmetric_gram", configs, do_bench=timed)
    monkeypatch.setitem(products_triton._tuners, "symmetric_gram", tuner)
    monkeypatch.setattr(products_triton, "_chosen", {})
    monkeypatch.setattr(products_triton, "SMALL_PROBLEM", 0)  # every size goes to the tuner
    return ran, tuner


def test_autotuned_sumsq_counts_only_the_tiles_of_the_configuration_that_ran(monkeypatch):
    # symmetric_gram's partial ||H||^2 buffer has one slot per upper tile of the narrowest
    # tiling, and every autotuning trial fills the slots of its own tiling. When a wider tiling
    # (fewer slots) wins, slots past its own may still hold a narrower trial's shares. This
    # drives the real triton.autotune machinery (in the interpreter on a CPU) into that case:
    # two tile widths, and a benchmark that runs each trial and makes the wider one win.
    def do_bench(ran, kernel_call, quantiles):
        kernel_call()
        return [1.0 if ran[-1] == 64 else 2.0] * len(quantiles)

    ran, tuner = tuned_symmetric_gram(monkeypatch, do_bench)
    X, Y = randn(2, 40, 150), randn(2, 40, 150, seed=1)  # 15 tiles of 32, 6 of 64
    H, sumsq = products_triton.symmetric_gram(X, Y, zero_diagonal=True, want_sumsq=True)
    assert ran == [32, 64, 64] and tuner.best_config.kwargs["BLOCK"] == 64  # two trials, the winner
    H_ref, sumsq_ref = products_torch.symmetric_gram(X, Y, zero_diagonal=True, want_sumsq=True)
    assert max_error(H, H_ref) < 1e-4
    assert torch.allclose(sumsq, sumsq_ref, rtol=1e-5), (sumsq, sumsq_ref)
    with pytest.raises(ValueError, match="narrower"):  # their tiles would not fit the slots
        products_triton.make_tuner("symmetric_gram", [triton.Config({"BLOCK": 16, "BLOCK_K": 16})])


def test_a_configuration_is_tuned_per_precision(monkeypatch):
    # The pruning keeps different configurations per PRECISION (3xTF32 stages one more tile on
    # sm_90): one tuned under TF32 must not be reused for a 3xTF32 launch of the same shape.
    def do_bench(ran, kernel_call, quantiles):
        kernel_call()
        return [1.0 if ran[-1] == 64 else 2.0] * len(quantiles)

    ran, _ = tuned_symmetric_gram(monkeypatch, do_bench)
    X, Y = randn(2, 40, 150), randn(2, 40, 150, seed=1)
    products_triton.symmetric_gram(X, Y)                       # fp32 operands: 3xTF32
    with kernels.tf32_products():
        products_triton.symmetric_gram(X, Y)                   # the same shape at TF32: tuned again
        products_triton.symmetric_gram(X, Y)                   # then the chosen one, untimed (no hook)
    assert ran == [32, 64, 64, 32, 64, 64]  # two trials and the winner, per precision


def test_tiles_by_rule_take_the_first_kept_configuration_without_timing(monkeypatch):
    # HSDP replicas each solve every matrix: a tile chosen by each process's own timing could
    # differ between them and round differently. By rule, the first configuration the pruning
    # keeps runs, and no trial is timed.
    def do_bench(ran, kernel_call, quantiles):
        raise AssertionError("timed a trial")

    ran, _ = tuned_symmetric_gram(monkeypatch, do_bench)
    monkeypatch.setattr(products_triton, "TILES_BY_RULE", False)
    kernels.tiles_by_rule()
    X, Y = randn(2, 40, 150), randn(2, 40, 150, seed=1)
    H = products_triton.symmetric_gram(X, Y, zero_diagonal=True)[0]
    assert ran == []  # no autotuner trial ran (its pre-hooks record them)
    assert [config.kwargs["BLOCK"] for config in products_triton._chosen.values()] == [32]
    assert max_error(H, products_torch.symmetric_gram(X, Y, zero_diagonal=True)[0]) < 1e-4


def test_fp32_dot_precision_follows_torch():
    matmul = torch.backends.cuda.matmul
    if not hasattr(matmul, "fp32_precision"):
        pytest.skip("torch before 2.9 has only the legacy precision API")
    saved = matmul.fp32_precision
    try:
        assert products_triton.fp32_precision() == ("tf32" if saved == "tf32" else "tf32x3")
        matmul.fp32_precision = "tf32"  # what torch.set_float32_matmul_precision("high") sets
        assert products_triton.fp32_precision() == "tf32"
        matmul.fp32_precision = "ieee"
        assert products_triton.fp32_precision() == "tf32x3"
    finally:
        matmul.fp32_precision = saved


# --- dispatch: the Triton path really runs, once per bank, and never falls back -----------

def test_triton_backend_launches_one_kernel_per_product_per_bank(monkeypatch):
    for name in ("sym_product", "matmul_add", "symmetric_gram"):  # the torch twin must not run
        monkeypatch.setattr(products_torch, name, lambda *a, **k: pytest.fail("torch twin ran"))
    counts = []
    for batch in (1, 4):
        before = dict(products_triton.LAUNCHES)
        msign(randn(batch, 40, 72), steps=5, polish_steps=2, backend="triton")
        counts.append({k: v - before.get(k, 0) for k, v in products_triton.LAUNCHES.items()})
    # Polar Express step: S = X X^T, B = b S + c S^2, X <- a X + B X; Newton-Schulz step: b S, a X + b S X
    assert counts[0] == counts[1] == {"sym_product": 5 * 2 + 2, "matmul_add": 5 + 2, "symmetric_gram": 0}


def test_auto_backend_picks_triton_exactly_on_cuda():
    X = randn(2, 40, 72)
    before = sum(products_triton.LAUNCHES.values())
    msign(X, steps=1, backend="auto")
    launched = sum(products_triton.LAUNCHES.values()) - before
    assert launched == (3 if DEVICE == "cuda" else 0)  # one Polar Express step: three products
    assert kernels.products_for("auto", X.double()) is products_torch  # a dtype the kernels do not take


def test_bad_backends_raise_user_errors():
    X = randn(8, 8)
    with pytest.raises(BackendError, match="unknown kernel backend"):
        msign(X, backend="cuda")
    with pytest.raises(BackendError, match="takes"):
        msign(X.double(), backend="triton")


def test_triton_without_cuda_or_interpreter_raises_instead_of_falling_back():
    # A fresh process without TRITON_INTERPRET, on CPU tensors: no usable Triton backend.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import torch, kernels\n"
            "try:\n"
            "    kernels.msign(torch.randn(8, 8), backend='triton')\n"
            "except kernels.BackendError as err:\n"
            "    print('raised:', err)\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "raised: kernel backend 'triton' needs CUDA tensors" in result.stdout


def test_kept_constants_stay_within_their_byte_budget(monkeypatch):
    # kernels.constants keeps a pattern per shape; past LIMIT_BYTES nothing more is kept
    from kernels import constants
    monkeypatch.setattr(constants, "LIMIT_BYTES", 1000)
    monkeypatch.setattr(constants, "_KEPT", {})
    like = torch.zeros(1)
    big = constants.kept("big", (20, 20), like, lambda: torch.ones(20, 20))  # 1600 bytes: made each time
    assert constants.kept("big", (20, 20), like, lambda: torch.ones(20, 20)).data_ptr() != big.data_ptr()
    small = constants.kept("small", (10,), like, lambda: torch.ones(10))
    assert constants.kept("small", (10,), like, lambda: torch.ones(10)).data_ptr() == small.data_ptr()
    for n in range(20):  # 400 bytes each: the kept ones are dropped when the next would pass the budget
        constants.kept("n", (n,), like, lambda: torch.ones(100))
        assert sum(t.numel() * t.element_size() for _, t in constants._KEPT.values()) <= 1000
