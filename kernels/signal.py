"""The last step of solver.tangent_signal: from three per-matrix sums to whether G has a tangent
part above rounding,

    t2 = g2 - m2 / 2      (||Proj_T G||_F^2 in q x q: ||G||_F^2 - <M0, pair M0> / 2)
    s2 = y2 / k           (the k-probe sketch of the same)
    signal = all finite (s2, t2, g2)  and  (s2 > tol^2 g2  or  t2 > 1e-4 g2)  and  g2 > 0

eleven elementwise ops on (n,) vectors: as torch ops eleven kernel launches for a few numbers, as
the Triton kernel (signal_triton.py) one. The torch twin is the reference and runs off CUDA.
"""
import torch

from kernels.constants import kept

EXACT_FACTOR = 1e-4  # t2 > EXACT_FACTOR g2: the q x q estimate sees the signal (10x its TF32 noise)


def signal_from_sums_torch(g2, m2, y2, probes, tol):
    t2 = torch.sub(g2, m2, alpha=0.5)  # the product by 0.5 exact: g2 - 0.5 m2 in one launch
    s2 = y2 / probes
    # the three tests against multiples of g2 as one comparison of stacked values
    values = torch.stack([s2, t2, g2])
    factors = kept(("signal factors", tol), (3,), g2, lambda: torch.tensor(
        [tol * tol, EXACT_FACTOR, 0.0], dtype=torch.float64).to(g2.dtype).to(g2.device))
    above = values > factors.view((3,) + (1,) * g2.dim()) * g2
    finite = values * 0 == 0  # 0 for a finite value, NaN otherwise: 2 launches where isfinite takes 5
    return finite.all(dim=0) & (above[0] | above[1]) & above[2]


def signal_from_sums(g2, m2, y2, probes, tol, backend="auto"):
    """The signal above for g2, m2, y2 (n,) of one dtype (`probes` = k), by `backend`."""
    from kernels import triton_selected, vectors_take_triton  # the same dispatch as the products
    if not triton_selected(backend, g2) or not vectors_take_triton(g2, m2, y2):
        return signal_from_sums_torch(g2, m2, y2, probes, tol)
    from kernels import signal_triton
    return signal_triton.signal_from_sums(g2, m2, y2, probes, tol)
