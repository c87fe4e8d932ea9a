"""The precision of the fp32 products: 3xTF32 (close to IEEE fp32, the default) or TF32.

TF32 keeps fp32's exponent and 10 of its 23 mantissa bits; tensor cores multiply TF32 operands
and accumulate in fp32, at 3x the rate of 3xTF32 (which splits each operand into a TF32 head
and tail to recover fp32 accuracy). Inside `tf32_products()`:

* the Triton kernels pass input_precision="tf32" for fp32 operands (fp32_precision);
* the torch twin (products_torch) rounds its fp32 operands to TF32 (round to nearest even), on any
  device, so that a CPU run computes what TF32 tensor cores would, up to accumulation order.
  The hardware's conversion may truncate instead of rounding; the solver's direction quality
  is the same either way (docs/solver-tuning.md).

Accumulators and epilogue terms (the C of beta C + alpha B X) are not rounded: the kernels add
them in fp32. The scope is explicit and nested-safe; nothing here touches torch's global
matmul settings (cuBLAS calls outside the kernels keep whatever the user chose).
"""
import contextlib

import torch

_depth = 0
_bf16_depth = 0


@contextlib.contextmanager
def tf32_products(enabled=True):
    """Products of fp32 operands run at TF32 inside (see the module docstring); enabled=False:
    nothing changes (for scopes that depend on a setting)."""
    global _depth
    _depth += int(enabled)
    try:
        yield
    finally:
        _depth -= int(enabled)


@contextlib.contextmanager
def bf16_products(enabled=True):
    """Products of fp32 operands read them rounded to bf16 inside (tensor cores at bf16's rate,
    twice TF32's), accumulating and writing fp32 as before: for products whose result a later
    fp32 step corrects or whose inputs were bf16-accurate already (the callers say why). Takes
    precedence over tf32_products(); enabled=False: nothing changes. The Triton kernels cast each
    fp32 tile to bf16 before tl.dot (products_triton, PRECISION "bf16"); the torch twin rounds
    its operands (round to nearest even), as for TF32."""
    global _bf16_depth
    _bf16_depth += int(enabled)
    try:
        yield
    finally:
        _bf16_depth -= int(enabled)


def bf16_active():
    """Do products of fp32 operands read them rounded to bf16 here?"""
    return _bf16_depth > 0


def tf32_active():
    """Do products read TF32 operands here? (The products' precision only: how many steps a
    computation runs is decided by its caller's plan, never here.)"""
    return _depth > 0


def fp32_precision():
    """tl.dot input precision for fp32 tensors: TF32 inside tf32_products() and
    where torch lets its CUDA fp32 matmuls use TF32, 3xTF32 (close to fp32) elsewhere (torch's
    default); "bf16" (not a tl.dot precision: the kernels cast the tiles) inside
    bf16_products()."""
    if bf16_active():
        return "bf16"
    if tf32_active():
        return "tf32"
    # torch.backends.cuda.matmul.fp32_precision reflects both the new API and the legacy
    # set_float32_matmul_precision ("none" = never set); the legacy getter raises once the
    # new API was used.
    setting = getattr(torch.backends.cuda.matmul, "fp32_precision", None)
    if setting is None:  # torch before 2.9
        setting = "ieee" if torch.get_float32_matmul_precision() == "highest" else "tf32"
    return "tf32" if setting == "tf32" else "tf32x3"


def round_to_tf32(X):
    """X with its fp32 mantissa rounded to TF32's 10 bits (nearest, ties to even); other dtypes
    pass unchanged. Finite values only (the solver's are): a carry into the exponent is the
    correct rounding up, and values within half a TF32 ulp of fp32's largest would overflow."""
    if X.dtype != torch.float32:
        return X
    bits = X.contiguous().view(torch.int32)
    # add half an ulp of the kept bits (minus one, plus the lowest kept bit: ties to even), then cut
    bits = (bits + (0x0FFF + ((bits >> 13) & 1))) & ~0x1FFF
    return bits.view(torch.float32)


def operand(X):
    """A product's operand as the current precision reads it (products_torch)."""
    if _bf16_depth > 0 and X.dtype == torch.float32:
        return X.to(torch.bfloat16).to(torch.float32)
    return round_to_tf32(X) if _depth > 0 else X
