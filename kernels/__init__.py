"""Kernels of the optimizer's hot loop: the matrix sign and the Gram-space tangent operations.

Every function takes `backend` and this dispatch alone decides which products run:

    "torch"   plain torch ops (products_torch.py): any device, any float dtype; the reference
    "triton"  fused Triton kernels (products_triton.py): CUDA tensors of fp32/bf16/fp16, or any
              such tensors under the Triton interpreter (TRITON_INTERPRET=1 set before the
              kernels are first used; the tests do that on CPU). Without either it raises
              BackendError: never a silent fallback to torch.
    "auto"    "triton" for CUDA tensors of a dtype the kernels take, "torch" otherwise

The algorithms (matrix_sign.py, tangent.py) are written once over those products.
logit_max.py (QK-Clip's per-head causal maximum of q . k, training/qk_clip.py) has its own
Triton kernel and torch twin under the same backends.
"""
import torch

from errors import UserError
from kernels import matrix_sign, products_torch, tangent
from kernels.moment_bound import bound_from_moments  # noqa: F401  (norm_bound's last step, kernels/moment_bound.py)
from kernels.momentum import momentum_update  # noqa: F401  (the optimizer's momentum update, kernels/momentum.py)
from kernels.signal import signal_from_sums  # noqa: F401  (solver.tangent_signal's last step, kernels/signal.py)
from kernels.constants import scalar
from kernels.precision import bf16_products, tf32_products  # noqa: F401  (re-exported: the solver's scopes)

BACKENDS = ("auto", "triton", "torch")
TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class BackendError(UserError):
    """The requested kernel backend cannot run these tensors."""


def _triton_products():
    """The Triton products module, or the reason it cannot be imported."""
    try:
        from kernels import products_triton
    except ImportError as err:
        return None, f"Triton cannot be imported ({err})"
    return products_triton, None


def tiles_by_rule(on=True):
    """Pick the Triton kernels' tiles by a rule (the first configuration the pruning keeps), not
    by each process's timing: processes that must compute the same bits (HSDP replicas) then do.
    A no-op where Triton cannot be imported (the torch products have no tiles)."""
    module, _ = _triton_products()
    if module is not None:
        module.TILES_BY_RULE = on


def triton_available():
    """Can the fused kernels be imported here (the "auto" backend's choice on CUDA)?"""
    return _triton_products()[0] is not None


def check_backend(backend, device):
    """Raise BackendError unless `backend` can run tensors on `device` (torch.device or str)."""
    if backend not in BACKENDS:
        raise BackendError(f"unknown kernel backend {backend!r}; valid: {', '.join(BACKENDS)}")
    if backend != "triton":
        return
    module, reason = _triton_products()
    if module is None:
        raise BackendError(f"kernel backend 'triton' is unavailable: {reason}")
    if torch.device(device).type != "cuda" and not module.INTERPRETED:
        raise BackendError(
            f"kernel backend 'triton' needs CUDA tensors, got {torch.device(device).type} ones "
            "(on a CPU, TRITON_INTERPRET=1 runs the kernels in the Triton interpreter); "
            "use backend 'auto' or 'torch' instead")


def triton_selected(backend, *tensors):
    """Does `backend` run `tensors` on the Triton kernels (True) or on the torch twins (False)?
    Raises BackendError where it cannot run them at all (see the module docstring)."""
    device = tensors[0].device
    check_backend(backend, device)
    if backend == "torch":
        return False
    dtype = tensors[0].dtype
    if backend == "auto":  # CUDA without a usable Triton: the torch twins still run
        return device.type == "cuda" and dtype in TRITON_DTYPES and triton_available()
    if dtype not in TRITON_DTYPES:
        raise BackendError(f"kernel backend 'triton' takes {', '.join(map(str, TRITON_DTYPES))}, got {dtype}")
    return True


def vectors_take_triton(*vectors):
    """Whether per-matrix vectors (n,) can go to an elementwise Triton kernel (moment_bound,
    signal): one shape, one of TRITON_DTYPES, contiguous. bench.op_count prices by the same test."""
    first = vectors[0]
    return first.dtype in TRITON_DTYPES and all(
        v.shape == first.shape and v.dtype == first.dtype and v.is_contiguous() for v in vectors)


def products_for(backend, *tensors):
    """The products module (`products_torch` or `products_triton`) that runs `tensors`."""
    return _triton_products()[0] if triton_selected(backend, *tensors) else products_torch


def msign(X, steps=5, polish_steps=0, backend="auto", schedule=None):
    """Polar factor U V^T of X (..., m, n), either orientation: `steps` iterations of
    `schedule` (default Polar Express; matrix_sign.CLIP_SCHEDULE for ADMM's spectral clip),
    then `polish_steps` Newton-Schulz ones (see matrix_sign.py)."""
    return matrix_sign.msign(X, steps, polish_steps, products_for(backend, X), schedule)


def orthonormalize_near(X, steps=3, backend="auto", tf32_correction=False):
    """Polar factor of an X already close to orthonormal, by `steps` Newton-Schulz iterations
    (tf32_correction: their small correction products at TF32, see matrix_sign.py)."""
    return matrix_sign.orthonormalize_near(X, steps, products_for(backend, X), tf32_correction)


def tangent_residual(W, A, manifold, backend="auto", with_norm=False):
    """H = P(W^T A + A^T W) for tall W, A (..., p, q); with_norm: (H, ||H||_F^2 per matrix)."""
    return tangent.tangent_residual(W, A, manifold, products_for(backend, W, A), with_norm)


def preconditioned(W, A, manifold, d2, alpha=1.0, backend="auto"):
    """alpha P(W^T A + A^T W) / (d_i^2 + d_j^2), d2 (..., q) the squared column norms."""
    return tangent.preconditioned(W, A, manifold, d2, alpha, products_for(backend, W, A))


def tangent_projection(W, A, manifold, d2, backend="auto", tf32_correction=False):
    """A - W P(W^T A + A^T W) / (d_i^2 + d_j^2): the projection onto the tangent space at W
    (tf32_correction: the product W M at TF32, for A tangent up to rounding; tangent.py)."""
    return tangent.tangent_projection(W, A, manifold, d2, products_for(backend, W, A), tf32_correction)


def symmetric_part(A, X, backend="auto"):
    """(A^T X + X^T A) / 2."""
    return tangent.symmetric_part(A, X, products_for(backend, A, X))


def sym_product(X, alpha=1.0, backend="auto"):
    """alpha X X^T (..., m, m) for X (..., m, k); the fused kernel computes the upper tiles only."""
    return products_for(backend, X).sym_product(X, alpha)


def matmul_add(B, X, C, alpha=1.0, beta=1.0, backend="auto"):
    """beta C + alpha B X."""
    return products_for(backend, B, X, C).matmul_add(B, X, C, alpha, beta)


def matmul(B, X, backend="auto"):
    """B X at the kernels' precision (fp32 operands: 3xTF32 on GPUs, TF32 inside tf32_products()),
    where a plain torch matmul would run IEEE fp32 on CUDA cores. matmul_add with beta = 0 and a
    stride-0 zero for C: nothing of size is read or written besides B, X and the result."""
    zero = scalar(0.0, X).expand(B.shape[:-1] + X.shape[-1:])  # kept: no fill launch per call
    return matmul_add(B, X, zero, alpha=1.0, beta=0.0, backend=backend)
