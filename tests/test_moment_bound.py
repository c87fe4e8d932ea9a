"""kernels/moment_bound.py: the norm bound's last step (the moments of P to the bound on lam_1) as
one Triton launch, against its torch twin (the interpreter on a CPU), through
norm_bound.top_eigenvalue_bound on both backends against the exact top eigenvalue, and compiled
for the GPUs (kernels/aot.py)."""
import pytest
import torch

from kernels import aot
from kernels.moment_bound import bound_from_moments, bound_from_moments_torch
from manifolds.norm_bound import top_eigenvalue_bound

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # bench/gpu_check.sh runs this file on a GPU
cpu_only = pytest.mark.skipif(DEVICE == "cuda", reason="CPU work (builds): CI runs it")


def moments(n, q, seed):
    """t, f, m, log_scale of n matrices as top_eigenvalue_bound forms them (f >= t^2 / q)."""
    g = torch.Generator().manual_seed(seed)
    mu = torch.rand(n, q, generator=g) ** 8  # eigenvalues of P in [0, 1], a few near the top
    t, f = mu.sum(dim=-1), mu.square().sum(dim=-1)
    m = torch.rand(n, generator=g) + 0.5
    log_scale = torch.randn(n, generator=g)
    return [x.to(DEVICE) for x in (t, f, m, log_scale)]


@pytest.mark.parametrize("n", [1, 5, 300])  # one matrix, a part-filled block, more than one block
def test_the_kernel_matches_its_twin(n):
    t, f, m, log_scale = moments(n, 64, seed=n)
    got = bound_from_moments(t, f, m, log_scale, 64, 10, backend="triton")
    want = bound_from_moments_torch(t, f, m, log_scale, 64, 10)
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=2e-6, atol=0)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_the_bound_holds_and_is_tight_on_both_backends(backend):
    """top_eigenvalue_bound with its last step on either backend: above lam_1 (an upper bound) and
    within 1.1e-3 of it (its docstring's figure) on answers' Grams, a flat spectrum and a lone top."""
    g = torch.Generator().manual_seed(0)
    A = torch.linalg.qr(torch.randn(6, 48, 16, generator=g)).Q * torch.linspace(0.3, 1.0, 16)
    S = (A.mT @ A).to(DEVICE)
    S[0] = torch.eye(16, device=DEVICE) * 0.7  # flat
    bound = top_eigenvalue_bound(S, 10, backend)
    exact = torch.linalg.eigvalsh(S.double().cpu())[..., -1]
    assert (bound.cpu().double() >= exact * (1 - 1e-6)).all()
    assert (bound.cpu().double() <= exact * (1 + 1.1e-3)).all()


@cpu_only
def test_the_kernel_compiles_for_both_gpus():
    from kernels import moment_bound_triton
    signature = {name: ("constexpr" if name == "BLOCK" else "i32" if name == "n"
                        else "*fp32" if name in ("T", "F", "M", "L", "Out") else "fp32")
                 for name in moment_bound_triton._bound_kernel.arg_names}
    specs = aot.function_specs("kernels.moment_bound_triton", "_bound_kernel", signature,
                               {"BLOCK": moment_bound_triton.BLOCK})
    for result in aot.run(specs, n_jobs=2, builder=aot.build_function):
        assert result["ok"], f"{result['target']}: {result.get('error')}"
        assert result["spill_stores"] == 0, result
