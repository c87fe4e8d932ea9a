"""The three matrix products of the optimizer's hot loop as fused Triton kernels.

Twin of `products_torch.py` (same functions, same arguments, same results up to rounding):

    sym_product(X, alpha, C, beta)   = alpha X X^T + beta C                      (C symmetric)
    matmul_add(B, X, C, alpha, beta) = beta C + alpha B X
    symmetric_gram(X, Y, ...)        = alpha P(X^T Y + Y^T X) / (d_i^2 + d_j^2),  ||P(.)||_F^2

Design:
- One launch per bank: the grid is (tiles, batch), so a stack of same-shape matrices is one
  kernel call whatever its size. Strides are arguments, so transposed views (the tall/wide
  orientation switch) cost no copy.
- Symmetric outputs (the first and third product) are computed on the upper-triangle tiles
  only, enumerated column by column (t = j (j + 1) / 2 + i, i <= j); each program writes its
  tile and, off the diagonal, the transposed tile. X X^T costs half of a full product, and so
  does S S^T = S^2 (S symmetric). Diagonal tiles are symmetrised so outputs are exactly
  symmetric. An input said to be symmetric (C) is read on the upper tiles only.
- Everything after the dot products happens in the epilogue, in fp32, on the tile in registers:
  the scalars, the "+ beta C" identity term of a polynomial step, the DGram off-diagonal
  projection, the division by (d_i^2 + d_j^2), the per-matrix step size, the partial
  ||.||_F^2 for the stopping test (one slot per tile, summed afterwards: deterministic, unlike
  atomics). One pass over the output tiles, one store.
- tl.dot accumulates in fp32. bf16/fp16 inputs feed the tensor cores directly. fp32 inputs use
  3xTF32 (about 22-bit products, close to fp32) under torch's default fp32 matmul precision,
  and plain TF32 where torch was told to allow TF32 for its own fp32 matmuls.
- Tiles: autotuned on the GPU among four 64/128-wide configurations (4-8 warps, 3-5
  pipeline stages) for problems of GPT-2 size, one 32-wide configuration for small problems.
  The autotuner first drops the configurations the device cannot run or that spill badly for
  the operands' dtype (keeps_config; figures from ahead-of-time builds, bench/aot_compile.py).
  Under the Triton interpreter (TRITON_INTERPRET=1, tests on CPU) only the 32-wide
  configuration exists, and tiles are cast to fp32 before tl.dot: the interpreter's bf16 dot
  and bf16 arithmetic are wrong, its fp32 ones exact.
"""
import functools
from collections import Counter

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from kernels.precision import fp32_precision

# Kernel launches per function: lets tests prove that the Triton path ran, and how often.
LAUNCHES = Counter()
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SMALL = 32            # the tile width of small problems and of the interpreter
SMALL_PROBLEM = 256   # output dimensions below this use the SMALL configuration


@triton.jit
def _upper_tile(t):
    """(i, j), i <= j, of the t-th upper-triangle tile, with t = j (j + 1) / 2 + i."""
    j = ((tl.sqrt(8.0 * t.to(tl.float32) + 1.0) - 1.0) * 0.5).to(tl.int32)
    j = tl.where(j * (j + 1) // 2 > t, j - 1, j)          # guard against sqrt rounding
    j = tl.where((j + 1) * (j + 2) // 2 <= t, j + 1, j)
    return t - j * (j + 1) // 2, j


@triton.jit
def _store_symmetric(Out, acc, i, j, rows_i, rows_j, n, som, son):
    """Store the (i, j) tile and, off the diagonal, its transpose as the (j, i) tile."""
    value = acc.to(Out.dtype.element_ty)
    tl.store(Out + rows_i[:, None] * som + rows_j[None, :] * son, value,
             mask=(rows_i[:, None] < n) & (rows_j[None, :] < n))
    if i != j:
        tl.store(Out + rows_j[:, None] * som + rows_i[None, :] * son, tl.trans(value),
                 mask=(rows_j[:, None] < n) & (rows_i[None, :] < n))


@triton.jit
def _panel_product(acc, L, slr, slk, R, srk, src, rows, cols, n_rows, n_cols, K,
                   CAST_FP32: tl.constexpr, PRECISION: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc + L[rows, :] R[:, cols], over K in steps of BLOCK_K with fp32 accumulation.
    (slr, slk) and (srk, src) are the strides of L and R; entries past n_rows, n_cols or K read 0."""
    ks = tl.arange(0, BLOCK_K)
    left = L + rows[:, None] * slr + ks[None, :] * slk
    right = R + ks[:, None] * srk + cols[None, :] * src
    for k in range(0, K, BLOCK_K):
        a = tl.load(left, mask=(rows[:, None] < n_rows) & (ks[None, :] + k < K), other=0.0)
        b = tl.load(right, mask=(ks[:, None] + k < K) & (cols[None, :] < n_cols), other=0.0)
        if PRECISION == "bf16":  # fp32 tiles read as bf16 (kernels.precision.bf16_products)
            a, b = a.to(tl.bfloat16), b.to(tl.bfloat16)
            if CAST_FP32:  # the interpreter's bf16 arithmetic is wrong: the rounded values in fp32
                acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
        else:
            if CAST_FP32:
                a, b = a.to(tl.float32), b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
        left += BLOCK_K * slk
        right += BLOCK_K * srk
    return acc


def _sym_product_kernel(X, C, Out, alpha, beta, M, K,
                        sxb, sxm, sxk, scb, scm, scn, sob, som, son,
                        HAS_C: tl.constexpr, CAST_FP32: tl.constexpr, PRECISION: tl.constexpr,
                        BLOCK: tl.constexpr, BLOCK_K: tl.constexpr):
    """Out = alpha X X^T + beta C on the upper tiles of Out (M x M); X is M x K."""
    i, j = _upper_tile(tl.program_id(0))
    batch = tl.program_id(1).to(tl.int64)
    rows_i = i * BLOCK + tl.arange(0, BLOCK)
    rows_j = j * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    X = X + batch * sxb  # X[i-block, :] times (X^T)[:, j-block]
    acc = _panel_product(acc, X, sxm, sxk, X, sxk, sxm, rows_i, rows_j, M, M, K,
                         CAST_FP32, PRECISION, BLOCK_K)
    if i == j:
        acc = 0.5 * (acc + tl.trans(acc))
    acc = acc * alpha
    if HAS_C:
        c = tl.load(C + batch * scb + rows_i[:, None] * scm + rows_j[None, :] * scn,
                    mask=(rows_i[:, None] < M) & (rows_j[None, :] < M), other=0.0)
        acc += beta * c.to(tl.float32)
    _store_symmetric(Out + batch * sob, acc, i, j, rows_i, rows_j, M, som, son)


def _matmul_add_kernel(B, X, C, Out, alpha, beta, M, N, K,
                       sbb, sbm, sbk, sxb, sxk, sxn, scb, scm, scn, sob, som, son,
                       CAST_FP32: tl.constexpr, PRECISION: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Out = beta C + alpha B X; B is M x K, X is K x N."""
    tiles_m = tl.cdiv(M, BLOCK_M)
    pid = tl.program_id(0)
    # consecutive programs walk down a column of tiles: they share the X block, B stays in L2
    pid_m, pid_n = pid % tiles_m, pid // tiles_m
    batch = tl.program_id(1).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc = _panel_product(acc, B + batch * sbb, sbm, sbk, X + batch * sxb, sxk, sxn, rows, cols, M, N, K,
                         CAST_FP32, PRECISION, BLOCK_K)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    c = tl.load(C + batch * scb + rows[:, None] * scm + cols[None, :] * scn, mask=mask, other=0.0)
    acc = beta * c.to(tl.float32) + alpha * acc
    tl.store(Out + batch * sob + rows[:, None] * som + cols[None, :] * son,
             acc.to(Out.dtype.element_ty), mask=mask)


def _symmetric_gram_kernel(X, Y, D2, Scale, Out, Sumsq, alpha, P, Q, sumsq_slots,
                           sxb, sxp, sxq, syb, syp, syq, sdb, sdq, sob, som, son,
                           ZERO_DIAGONAL: tl.constexpr, DIVIDE: tl.constexpr, HAS_SCALE: tl.constexpr,
                           WANT_SUMSQ: tl.constexpr,
                           CAST_FP32: tl.constexpr, PRECISION: tl.constexpr,
                           BLOCK: tl.constexpr, BLOCK_K: tl.constexpr):
    """Upper tiles of Out = alpha * scale_b * P(X^T Y + Y^T X) / (d2_i + d2_j) (Q x Q);
    X, Y are P x Q. Sumsq[b, t] = the tile's share of ||P(X^T Y + Y^T X)||_F^2."""
    t = tl.program_id(0)
    i, j = _upper_tile(t)
    batch = tl.program_id(1).to(tl.int64)
    cols_i = i * BLOCK + tl.arange(0, BLOCK)
    cols_j = j * BLOCK + tl.arange(0, BLOCK)
    X = X + batch * sxb
    Y = Y + batch * syb
    # tile (i, j) of X^T Y + Y^T X = (X^T)[i-block, :] Y[:, j-block] + (Y^T)[i-block, :] X[:, j-block]
    acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    acc = _panel_product(acc, X, sxq, sxp, Y, syp, syq, cols_i, cols_j, Q, Q, P,
                         CAST_FP32, PRECISION, BLOCK_K)
    acc = _panel_product(acc, Y, syq, syp, X, sxp, sxq, cols_i, cols_j, Q, Q, P,
                         CAST_FP32, PRECISION, BLOCK_K)
    if i == j:
        acc = 0.5 * (acc + tl.trans(acc))
    if ZERO_DIAGONAL:  # DGram: P = Off
        acc = tl.where(cols_i[:, None] == cols_j[None, :], 0.0, acc)
    if WANT_SUMSQ:  # an off-diagonal tile stands for itself and its mirror
        share = tl.sum(tl.sum(acc * acc, axis=1), axis=0) * tl.where(i == j, 1.0, 2.0)
        tl.store(Sumsq + batch * sumsq_slots + t, share)
    if DIVIDE:  # the Gram-space metric (d_i^2 + d_j^2)
        d2_i = tl.load(D2 + batch * sdb + cols_i * sdq, mask=cols_i < Q, other=1.0).to(tl.float32)
        d2_j = tl.load(D2 + batch * sdb + cols_j * sdq, mask=cols_j < Q, other=1.0).to(tl.float32)
        acc = acc / (d2_i[:, None] + d2_j[None, :])
    acc = acc * alpha
    if HAS_SCALE:
        acc = acc * tl.load(Scale + batch).to(tl.float32)
    _store_symmetric(Out + batch * sob, acc, i, j, cols_i, cols_j, Q, som, son)


# ----------------------------------------------------------------------------------------
# Configurations: autotuned on the GPU, one small configuration for small problems and the interpreter

_jit = {name: triton.jit(fn) for name, fn in (("sym_product", _sym_product_kernel),
                                               ("matmul_add", _matmul_add_kernel),
                                               ("symmetric_gram", _symmetric_gram_kernel))}
# under TRITON_INTERPRET=1 (read when triton.jit decorates), the kernels run in the interpreter
INTERPRETED = isinstance(_jit["sym_product"], InterpretedFunction)


def _square(block, block_k, warps, stages):
    return triton.Config({"BLOCK": block, "BLOCK_K": block_k}, num_warps=warps, num_stages=stages)


def _rect(block_m, block_n, block_k, warps, stages):
    return triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k},
                         num_warps=warps, num_stages=stages)


SMALL_CONFIGS = {"sym_product": _square(SMALL, SMALL, 4, 2),
                 "matmul_add": _rect(SMALL, SMALL, SMALL, 4, 2),
                 "symmetric_gram": _square(SMALL, SMALL, 4, 2)}
def _square_tiles():
    return [_square(128, 64, 8, 3), _square(128, 32, 4, 4), _square(64, 64, 4, 4), _square(64, 32, 4, 5)]


GPU_CONFIGS = {
    "sym_product": _square_tiles(),
    "matmul_add": [_rect(128, 128, 64, 8, 3), _rect(128, 256, 64, 8, 3), _rect(64, 128, 64, 4, 4),
                   _rect(128, 64, 32, 4, 4)],
    "symmetric_gram": _square_tiles(),
}


def _tile(config):
    kw = config.kwargs
    return kw.get("BLOCK_M", kw.get("BLOCK")), kw.get("BLOCK_N", kw.get("BLOCK")), kw["BLOCK_K"]


def shared_memory_estimate(config, dtype, capability, precision="tf32x3"):
    """Shared memory (bytes) a configuration's build allocates, an upper bound calibrated on
    ahead-of-time builds (bench/aot_compile.py, Triton 3.6 and 3.7): the software pipeline's
    buffers of the two operand tiles, (BLOCK_M + BLOCK_N) * BLOCK_K elements each. sm_8x
    keeps num_stages - 1 of them (cp.async), sm_90 num_stages; there 3xTF32 stages one more
    BLOCK_M x BLOCK_K tile in some builds. No epilogue needs more (nor any flag set). Other
    targets are not calibrated: num_stages buffers."""
    block_m, block_n, block_k = _tile(config)
    buffers = max(1, config.num_stages - 1) if capability[0] == 8 else config.num_stages
    extra = block_m * block_k if capability[0] >= 9 and dtype == torch.float32 and precision == "tf32x3" else 0
    return (buffers * (block_m + block_n) * block_k + extra) * dtype.itemsize


def keeps_config(config, dtype, capability, smem_limit, precision="tf32x3"):
    """Whether the autotuner should try `config` for `dtype` operands on a GPU of compute
    `capability` (major, minor) whose blocks may use `smem_limit` bytes of shared memory, with
    tl.dot's `precision` for fp32 operands. A pure function: the tests check it without a GPU.

    Dropped: builds whose shared memory exceeds the limit (they fail to launch: the fp32
    128 x 256 x 64 tiles on sm_80 and sm_90), and, for fp32 with 3xTF32 on sm_8x, tiles of
    128 rows: their builds spill 0.3-28 KB of registers (the 64-row ones at most 1.3 KB)."""
    if shared_memory_estimate(config, dtype, capability, precision) > smem_limit:
        return False
    if capability[0] == 8 and dtype == torch.float32 and precision == "tf32x3" and _tile(config)[0] >= 128:
        return False
    return True


_DEVICE_LIMITS = {}


def _device_limits(device):
    """(capability, shared memory a block may opt into) of a CUDA device, cached. The limit is
    the one Triton checks before a launch (else OutOfResources)."""
    if device not in _DEVICE_LIMITS:
        from triton.runtime import driver
        smem = driver.active.utils.get_device_properties(device.index)["max_shared_mem"]
        _DEVICE_LIMITS[device] = (torch.cuda.get_device_capability(device), smem)
    return _DEVICE_LIMITS[device]


def _prune(name, configs, named_args, **kwargs):
    """The autotuner's early_config_prune for kernel `name`: the configurations keeps_config
    keeps for this call's dtype and device, or the SMALL one if none is (it fits every GPU)."""
    operand = next(iter(named_args.values()))
    if operand.device.type != "cuda":  # the interpreter has no limits
        return configs
    capability, smem = _device_limits(operand.device)
    kept = [c for c in configs if keeps_config(c, operand.dtype, capability, smem, kwargs.get("PRECISION"))]
    return kept or [SMALL_CONFIGS[name]]


# PRECISION too: the pruning keeps different configurations per precision (3xTF32 stages one more
# tile on sm_90), so a configuration tuned under TF32 or bf16 may not fit a 3xTF32 launch of the
# same shape, which the solver makes (the retraction's Gram-space and final Grams)
TUNING_KEYS = {"sym_product": ["M", "K", "HAS_C", "PRECISION"], "matmul_add": ["M", "N", "K", "PRECISION"],
               "symmetric_gram": ["P", "Q", "ZERO_DIAGONAL", "DIVIDE", "HAS_BASE", "PRECISION"]}


def make_tuner(name, configs=None, do_bench=None):
    """The autotuner of kernel `name` over `configs` (GPU_CONFIGS[name] by default); `do_bench`
    replaces Triton's benchmarker (tests drive the tuner with it, in the interpreter too)."""
    configs = GPU_CONFIGS[name] if configs is None else configs
    if any(config.kwargs.get("BLOCK", SMALL) < SMALL for config in configs):
        raise ValueError(f"{name}: tiles narrower than {SMALL} would overrun the sumsq slots")
    return triton.autotune(configs, key=TUNING_KEYS[name], do_bench=do_bench,
                           prune_configs_by={"early_config_prune": functools.partial(_prune, name)})(_jit[name])


# GPU problems of GPT-2 size: autotuned among GPU_CONFIGS (the key's dtypes are added by Triton)
_tuners = {} if INTERPRETED else {name: make_tuner(name) for name in _jit}
_chosen = {}  # (name, key) -> the configuration the autotuner picked
# True: the first configuration the pruning keeps, with no timing. Processes that must compute
# the same bits (HSDP replicas, which each solve every matrix) cannot let each one's autotuner
# time its own choice: different tiles sum products in a different order. The trainer sets it
# under --fsdp with replicas (kernels.tiles_by_rule)
TILES_BY_RULE = False


def _launch(name, grid, args, size, key, **constexprs):
    """Launch kernel `name` once, for an output of `size` (rows, cols), on the device of its
    first operand args[0] (Triton launches on the current CUDA device); return the
    configuration that ran.

    Small problems and kernels without a tuner (all of them in the interpreter) use the SMALL
    configuration. Otherwise the first launch for a key goes through the autotuner (which
    benchmarks its configurations on the GPU); later ones call the kernel with the chosen
    configuration directly, which saves the autotuner's per-call Python work: it matters for
    768 x 768 banks, whose kernels take tens of microseconds.
    """
    device = args[0].device
    if device.type == "cuda" and device.index != torch.cuda.current_device():
        with torch.cuda.device(device):
            return _launch(name, grid, args, size, key, **constexprs)
    LAUNCHES[name] += 1
    if name not in _tuners or max(size) < SMALL_PROBLEM:
        config = SMALL_CONFIGS[name]
    else:
        slot = (name, key, constexprs.get("PRECISION"))  # per precision, as TUNING_KEYS
        config = _chosen.get(slot)
        if config is None and TILES_BY_RULE:
            tuner = _tuners[name]
            config = _prune(name, tuner.configs, dict(zip(tuner.arg_names, args)), **constexprs)[0]
            _chosen[slot] = config
        elif config is None:
            tuner = _tuners[name]
            tuner[grid](*args, **constexprs)
            _chosen[slot] = tuner.best_config
            return tuner.best_config
    _jit[name][grid](*args, **constexprs, **config.all_kwargs())
    return config


def upper_tiles(n, block):
    tiles = triton.cdiv(n, block)
    return tiles * (tiles + 1) // 2


# The constexpr flags the wrappers below launch each kernel with, for every call of the API
# (kernels/matrix_sign.py, kernels/tangent.py): what an ahead-of-time build must cover.
# tests/test_aot_compile.py checks the list against the wrappers' real launches.
_GRAM_FLAGS = ("ZERO_DIAGONAL", "DIVIDE", "HAS_SCALE", "WANT_SUMSQ")
WRAPPER_FLAGS = {
    "sym_product": [dict(HAS_C=False), dict(HAS_C=True)],
    "matmul_add": [{}],
    "symmetric_gram": [dict(zip(_GRAM_FLAGS, values)) for zero_diagonal in (False, True) for values in (
        (zero_diagonal, False, False, False),     # tangent_residual, symmetric_part
        (zero_diagonal, False, False, True),      # tangent_residual with ||H||^2
        (zero_diagonal, True, False, False),      # preconditioned, alpha a float
        (zero_diagonal, True, True, False))],     # preconditioned, alpha per matrix
}


# ----------------------------------------------------------------------------------------
# Python wrappers: flatten the batch, check the arguments, launch once


def _batched(T):
    """T (..., r, c) as (b, r, c): a view when the strides allow it."""
    return T if T.dim() == 3 else T.reshape((-1,) + T.shape[-2:])


def _check(shapes, **tensors):
    """The tensors have the shapes (`None` skips one) and one supported dtype: the kernels index
    them without bounds of their own, so a mismatch is an error here, not a wrong read there."""
    named = {name: T for name, T in tensors.items() if T is not None}
    for name, T in named.items():
        if tuple(T.shape) != tuple(shapes[name]):
            raise ValueError(f"Triton products: {name} has shape {tuple(T.shape)}, "
                             f"expected {tuple(shapes[name])}")
    dtype = next(iter(named.values())).dtype
    if any(T.dtype != dtype for T in named.values()) or dtype not in DTYPES:
        raise TypeError(f"Triton products take one dtype of {', '.join(map(str, DTYPES))}, got "
                        + ", ".join(f"{name} {T.dtype}" for name, T in named.items()))
    # input_precision only matters for fp32 operands; "tf32" is tl.dot's default for the others
    return dict(CAST_FP32=INTERPRETED, PRECISION=fp32_precision() if dtype == torch.float32 else "tf32")


def sym_product(X, alpha=1.0, C=None, beta=0.0):
    batch, (m, k) = X.shape[:-2], X.shape[-2:]
    options = _check(dict(X=X.shape, C=batch + (m, m)), X=X, C=C)
    X3 = _batched(X)
    out = torch.empty(X3.shape[0], m, m, dtype=X.dtype, device=X.device)
    C3 = out if C is None else _batched(C)
    grid = lambda meta: (upper_tiles(m, meta["BLOCK"]), X3.shape[0])  # noqa: E731
    args = (X3, C3, out, float(alpha), float(beta), m, k, *X3.stride(), *C3.stride(), *out.stride())
    _launch("sym_product", grid, args, (m, m), (m, k, C is not None, X.dtype), HAS_C=C is not None, **options)
    return out.reshape(batch + (m, m))


def matmul_add(B, X, C, alpha=1.0, beta=1.0):
    batch, (m, k), n = B.shape[:-2], B.shape[-2:], X.size(-1)
    options = _check(dict(B=B.shape, X=batch + (k, n), C=batch + (m, n)), B=B, X=X, C=C)
    B3, X3, C3 = _batched(B), _batched(X), _batched(C)
    out = torch.empty(B3.shape[0], m, n, dtype=C.dtype, device=C.device)
    grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),  # noqa: E731
                         B3.shape[0])
    args = (B3, X3, C3, out, float(alpha), float(beta), m, n, k,
            *B3.stride(), *X3.stride(), *C3.stride(), *out.stride())
    _launch("matmul_add", grid, args, (m, n), (m, n, k, C.dtype), **options)
    return out.reshape(batch + (m, n))


def symmetric_gram(X, Y, zero_diagonal=False, d2=None, alpha=1.0, want_sumsq=False):
    batch, q = X.shape[:-2], X.size(-1)
    options = _check(dict(X=X.shape, Y=X.shape), X=X, Y=Y)
    X3, Y3 = _batched(X), _batched(Y)
    b, p, q = X3.shape
    out = torch.empty(b, q, q, dtype=X.dtype, device=X.device)
    # d2 (..., q) may broadcast over the batch (Stiefel: all ones): a stride-0 view
    D2 = out[:, 0] if d2 is None else d2.expand(batch + (q,)).reshape(b, q)
    scale = isinstance(alpha, torch.Tensor)
    Scale = alpha.to(torch.float32).expand(batch).reshape(b) if scale else out
    slots = upper_tiles(q, SMALL)  # the most tiles any configuration has (none is narrower)
    Sumsq = torch.empty(b, slots, dtype=torch.float32, device=X.device) if want_sumsq else out
    grid = lambda meta: (upper_tiles(q, meta["BLOCK"]), b)  # noqa: E731
    args = (X3, Y3, D2, Scale, out, Sumsq, 1.0 if scale else float(alpha), p, q, slots,
            *X3.stride(), *Y3.stride(), *D2.stride(), *out.stride())
    flags = dict(ZERO_DIAGONAL=zero_diagonal, DIVIDE=d2 is not None, HAS_SCALE=scale, WANT_SUMSQ=want_sumsq)
    config = _launch("symmetric_gram", grid, args, (q, q), (p, q, X.dtype, *flags.values()),
                     **flags, **options)
    # Only the slots of the tiling that ran: the autotuner's trials of narrower tilings leave
    # theirs in the slots past it (and every slot of this tiling was just written, so no zeroing).
    sumsq = None
    if want_sumsq:
        sumsq = Sumsq[:, :upper_tiles(q, config.kwargs["BLOCK"])].sum(dim=-1).reshape(batch)
    return out.reshape(batch + (q, q)), sumsq
