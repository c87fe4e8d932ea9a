"""The benches on CPU, tiny shapes (bench/gpu_check.sh runs the GPU ones on a GPU)."""
import pytest
import torch

from bench.published import published_step
from manifolds import project_to_manifold


@pytest.mark.parametrize("shape", [(96, 32), (32, 96)])  # tall and wide DGram matrices
def test_published_step_runs_on_bf16_dgram(shape):
    # svdvals has no bf16 kernel: the published DGram retraction computes them in fp32
    torch.manual_seed(0)
    W = project_to_manifold(torch.randn(shape), "dgram")
    G = torch.randn(shape)
    new = published_step(W.bfloat16(), G.bfloat16(), "dgram", 0.02)
    assert new.dtype == torch.bfloat16 and new.shape == W.shape
    reference = published_step(W, G, "dgram", 0.02)
    assert torch.isfinite(new.float()).all()
    assert float((new.float() - reference).abs().max() / reference.abs().max()) < 0.05
