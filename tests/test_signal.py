"""kernels/signal.py: solver.tangent_signal's last step (three per-matrix sums to the signal flag)
as one Triton launch, against its torch twin in the interpreter on a CPU (the same decisions, on
the thresholds too), and compiled for the GPUs (kernels/aot.py)."""
import math

import pytest
import torch

from kernels import aot
from kernels.signal import EXACT_FACTOR, signal_from_sums, signal_from_sums_torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # bench/gpu_check.sh runs this file on a GPU
cpu_only = pytest.mark.skipif(DEVICE == "cuda", reason="CPU work (builds): CI runs it")
TOL = 3e-3  # solver.SIGNAL_TOL's TF32 value


def sums():
    """g2, m2, y2 of cases on both sides of each test: tangent parts well above and below the
    tolerance by either estimate, exactly on a threshold, no gradient, NaN and inf sums."""
    g2 = torch.tensor([1.0, 1.0, 1.0, 1.0, 4.0, 0.0, 1.0, math.nan, 1.0, 2.0, 1.0, math.inf])
    t2 = torch.tensor([0.5, 1e-6, 1e-6, EXACT_FACTOR * 2, 1e-5, 0.0, 0.3, 0.1, 0.2, 1e-9, 0.3, 0.1])
    s2 = torch.tensor([0.4, 1e-6, TOL * TOL * 2, 1e-9, 4 * TOL * TOL, 0.0, math.nan, 0.1, math.inf, 1e-9, 0.3, 0.1])
    # m2 = 2 (g2 - t2), y2 = 16 s2: t2 and s2 as the kernel and the twin recover them
    m2, y2 = 2 * (g2 - t2), 16 * s2
    m2[8] = -math.inf  # t2 = inf
    return [x.to(DEVICE) for x in (g2, m2, y2)]


@pytest.mark.parametrize("n", [12, 300])
def test_the_kernel_makes_the_twins_decisions(n):
    g2, m2, y2 = sums()
    if n > len(g2):  # more than one block, random values around the thresholds
        gen = torch.Generator().manual_seed(0)
        g2 = torch.cat([g2, torch.rand(n - 12, generator=gen).to(DEVICE)])
        m2 = torch.cat([m2, (2 * g2[12:].cpu() * (1 - torch.rand(n - 12, generator=gen) ** 8 * 1e-3)).to(DEVICE)])
        y2 = torch.cat([y2, (16 * g2[12:].cpu() * torch.rand(n - 12, generator=gen) * 2e-5).to(DEVICE)])
    got = signal_from_sums(g2, m2, y2, 16, TOL, backend="triton")
    want = signal_from_sums_torch(g2, m2, y2, 16, TOL)
    assert got.dtype == torch.bool and torch.equal(got, want)
    if n == 12:  # the cases as described: above, below, sketch above, exact above, at the threshold, ...
        assert want.tolist() == [True, False, True, True, False, False, False, False, False, False, True, False]


@cpu_only
def test_the_kernel_compiles_for_both_gpus():
    from kernels import signal_triton
    signature = {name: ("constexpr" if name == "BLOCK" else "i32" if name == "n" else
                        "*i1" if name == "Out" else "*fp32" if name in ("G2", "M2", "Y2") else "fp32")
                 for name in signal_triton._signal_kernel.arg_names}
    specs = aot.function_specs("kernels.signal_triton", "_signal_kernel", signature, {"BLOCK": signal_triton.BLOCK})
    for result in aot.run(specs, n_jobs=2, builder=aot.build_function):
        assert result["ok"], f"{result['target']}: {result.get('error')}"
        assert result["spill_stores"] == 0, result
