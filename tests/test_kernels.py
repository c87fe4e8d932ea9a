"""Matrix sign (polar factor) iterations against exact SVD."""
import pytest
import torch

from kernels import msign, orthonormalize_near


def polar(X):
    U, _, Vh = torch.linalg.svd(X.double(), full_matrices=False)
    return U @ Vh


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


def test_orthonormalize_near_converges_quadratically():
    torch.manual_seed(3)
    Q = polar(torch.randn(64, 16)).float()
    X = Q + 1e-2 * torch.randn(64, 16)
    for steps, bound in ((1, 1e-2), (2, 1e-4), (3, 1e-5)):  # error squares each step
        out = orthonormalize_near(X, steps=steps).double()
        assert (out.T @ out - torch.eye(16, dtype=torch.float64)).abs().max() < bound
    assert (orthonormalize_near(X, steps=3).double() - polar(X)).abs().max() < 1e-5


def test_orthonormalize_near_stays_stable_far_from_the_manifold():
    torch.manual_seed(4)
    X = 5.0 * torch.randn(40, 10)  # singular values far above sqrt(3): plain Newton-Schulz diverges
    out = orthonormalize_near(X, steps=12).double()
    assert torch.isfinite(out).all()
    assert (out.T @ out - torch.eye(10, dtype=torch.float64)).abs().max() < 1e-3
