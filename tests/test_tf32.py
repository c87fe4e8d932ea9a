"""TF32 products (kernels/precision.py) and the solver's TF32 inner iterations."""
import math

import pytest
import torch

import kernels
from kernels import products_torch
from kernels.precision import round_to_tf32, tf32_active, tf32_products
from manifolds.dual import SolverOptions, iteration_precision, solve_tall
from manifolds.geometry import geometry
from reference import random_point


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
    solve = lambda precision: solve_tall(W, G, manifold, None, SolverOptions(  # noqa: E731
        precision=precision, clip="polynomial", capturable=True, backend="torch")).A[0]
    A, exact = solve("tf32"), solve("fp32")
    assert geometry(manifold).tangent_residual(W[0].double(), A.double()).abs().max() <= 1e-5
    assert abs(torch.linalg.matrix_norm(A.double(), 2) - 1) <= 3e-3  # the power-iteration estimate, as in fp32
    # the iterations did run at TF32 (the answers differ by more than fp32 rounding) and reach
    # the same direction
    gap = ((A - exact).norm() / exact.norm()).item()
    assert 1e-5 < gap < 0.05
    G0 = G[0] / G[0].norm()
    assert (G0 * A).sum() >= 0.99 * (G0 * exact).sum()


def test_auto_precision_is_fp32_on_cpu_tf32_on_cuda():
    opts = SolverOptions()
    assert iteration_precision(opts, torch.zeros(2, 2)) == "fp32"
    assert iteration_precision(opts, torch.zeros(2, 2, device="meta")) == "fp32"
    if torch.cuda.is_available():
        assert iteration_precision(opts, torch.zeros(2, 2, device="cuda")) == "tf32"
        assert iteration_precision(opts, torch.zeros(2, 2, device="cuda", dtype=torch.float64)) == "fp32"
