"""Count what a piece of torch code would launch on a GPU, by watching its aten ops on any device.

    counter = OpCounter()
    with counter, triton_attribution(counter):
        opt.step()
    counter.summary()

OpCounter is a TorchDispatchMode: it sees every aten op after autograd and the
CompositeImplicit decompositions (torch.matmul arrives as mm / bmm, reshape as view or clone),
and not the ops a kernel runs inside itself. It counts
  * kernels: every op but pure views / metadata and allocations (VIEW_OPS), which launch nothing;
  * host syncs: the aten ops of manifolds.step_graph.HOST_READS (item(), bool(), float(),
    `if tensor:`) and the Tensor methods that copy to the host without one (tolist(), numpy(),
    cpu(), a blocking to("cpu"): manifolds.step_graph.HostReadMode), counted on CPU
    tensors too, where they cost nothing, because on a GPU they wait for the device;
  * tensor literals from host data (aten::lift_fresh of a tensor with dimensions, e.g.
    W.new_tensor([...])): on CUDA a blocking host-to-device copy, which in torch waits for the
    stream (memcpy_and_sync); a 0-dim one (`t[i] = 2.0`) is a fill kernel there, counted as such;
  * FLOPs of the dense products (mm, addmm, bmm, baddbmm, ...: 2 m n k each), labelled by the
    precision they would run at on a GPU (`product_precision`);
  * linear-algebra ops (eigh, cholesky, solve_triangular, ...) apart, with rough FLOP counts:
    they are not dense products, and on a GPU they are slow sequential kernels.

triton_attribution patches the three functions of kernels.products_torch (the torch twins of
the fused Triton kernels): one call is one Triton launch on the GPU, so the ops dispatched
inside it are not kernels of their own (they are fused into it) and its products land in a
"triton:<precision>" bucket. simulated_collectives replaces torch.distributed's collectives
by local no-ops that record the bytes each call sends, so an optimizer can be stepped "as rank
r of N" without launching processes.

Works under FakeTensorMode as well (enter the counter inside it): the counts are the same as
long as the code makes no data-dependent host decision; a host sync then raises
DataDependentOutputException, after the counter has recorded it.
"""
import contextlib
import functools
import os
import sys
from collections import Counter

import torch
from torch._prims_common import is_non_overlapping_and_dense_or_false as is_non_overlapping_and_dense
import torch.distributed as dist

from kernels.precision import fp32_precision
from manifolds import step_graph
from manifolds.step_graph import HOST_READS, HostReadMode

# Views, metadata and allocations: no kernel runs (empty* allocate from the caching allocator).
VIEW_OPS = frozenset((
    "view", "_unsafe_view", "_reshape_alias", "reshape", "t", "transpose", "permute", "expand",
    "expand_as", "slice", "select", "unsqueeze", "squeeze", "alias", "detach", "as_strided",
    "diagonal", "split", "split_with_sizes", "unbind", "chunk", "narrow", "unfold", "view_as",
    "view_as_real", "view_as_complex", "movedim", "numpy_T", "adjoint",
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "device", "size",
    "stride", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "dim",
))
SYNC_OPS = frozenset(HOST_READS)
LITERAL_OPS = frozenset(("lift_fresh", "lift_fresh_copy"))  # torch.tensor(data) / new_tensor(data): data from the host


def _shape(t):
    return tuple(t.shape)


def _batch(shape):
    n = 1
    for s in shape[:-2]:
        n *= s
    return n


def _mm(a, b, *_, **__):
    (m, k), n = _shape(a), _shape(b)[-1]
    return 2 * m * k * n


def _addmm(c, a, b, *_, **__):
    return _mm(a, b)


def _bmm(a, b, *_, **__):
    sa, sb = _shape(a), _shape(b)
    return 2 * sa[0] * sa[1] * sa[2] * sb[2]


def _baddbmm(c, a, b, *_, **__):
    return _bmm(a, b)


def _mv(a, v, *_, **__):
    m, n = _shape(a)
    return 2 * m * n


def _addmv(c, a, v, *_, **__):
    return _mv(a, v)


def _dot(a, b, *_, **__):
    return 2 * a.numel()


# Dense products: exact 2 m n k (multiply-adds counted as two; the epilogue's adds not counted).
PRODUCT_FLOPS = {"mm": _mm, "addmm": _addmm, "bmm": _bmm, "baddbmm": _baddbmm, "addbmm": _baddbmm,
                 "mv": _mv, "addmv": _addmv, "dot": _dot, "vdot": _dot}


def _square(A):
    return _batch(_shape(A)), _shape(A)[-1]


def _eigh(A, *args, **kwargs):
    b, n = _square(A)
    compute_v = kwargs.get("compute_v", args[1] if len(args) > 1 else True)
    return b * (9 if compute_v else 4 / 3) * n ** 3  # Golub & Van Loan: tridiagonalisation + QR


def _cholesky(A, *_, **__):
    b, n = _square(A)
    return b * n ** 3 / 3


def _solve_triangular(A, B, *_, **__):
    b, n = _square(A)
    return b * n * n * _shape(B)[-1]


def _lu(A, *_, **__):
    b, n = _square(A)
    return b * 2 * n ** 3 / 3


def _inv(A, *_, **__):
    b, n = _square(A)
    return b * 2 * n ** 3


def _qr(A, *_, **__):
    m, n = _shape(A)[-2:]
    k = min(m, n)
    return _batch(_shape(A)) * 2 * (2 * m * n * k - (m + n) * k * k + 2 * k ** 3 / 3)  # factor + Q


def _svd(A, *_, **__):
    m, n = _shape(A)[-2:]
    m, n = max(m, n), min(m, n)
    return _batch(_shape(A)) * (4 * m * n * n + 8 * n ** 3)  # reduced SVD, Golub & Van Loan (rough)


# Rough FLOPs of the linear-algebra ops (None: counted, no FLOP formula).
LINALG_FLOPS = {"_linalg_eigh": _eigh, "linalg_eigh": _eigh, "linalg_cholesky_ex": _cholesky,
                "cholesky": _cholesky, "linalg_solve_triangular": _solve_triangular,
                "triangular_solve": lambda B, A, *a, **k: _solve_triangular(A, B),
                "linalg_lu_factor_ex": _lu, "linalg_lu": _lu, "linalg_inv_ex": _inv, "linalg_qr": _qr,
                "geqrf": _qr, "_linalg_svd": _svd, "linalg_svd": _svd}
# linalg ops whose torch implementation checks LAPACK's `info` on the host: a sync on CUDA
# (the _ex variants and solve_triangular do not check).
CHECKS_INFO = frozenset(("_linalg_eigh", "linalg_eigh", "cholesky", "linalg_inv", "_linalg_svd", "linalg_svd"))


# CUDA's multi_tensor_apply (ATen/native/cuda/MultiTensorApply.cuh): a kernel per at most 320
# chunks of 65536 elements and at most depth_to_max_tensors[depth - 1] tensors, depth being the
# number of tensor lists the kernel reads and writes (an out-of-place op's result list included)
MTA_CHUNK, MTA_MAX_BLOCKS, MTA_MAX_TENSORS = 65536, 320, (110, 64, 48, 36, 30)


def foreach_fast_route(lists, same_dtype=True):
    """Whether CUDA takes a foreach op's fast path (ATen/native/ForeachUtils.h,
    check_fast_path_restrictions): every tensor strided, dense and on one device, one dtype in
    each list (and across lists unless `same_dtype` is False: _foreach_copy_), and the tensors at
    each index of the lists of the same sizes and strides. A list of 0-dim tensors beside a list of
    matrices (a per-matrix factor) fails the last: the slow path, a kernel per tensor."""
    first = lists[0][0]
    for tensors in lists:
        for t in tensors:
            if (t.device != first.device or t.layout != torch.strided or not is_non_overlapping_and_dense(t)
                    or t.dtype != tensors[0].dtype or (same_dtype and t.dtype != first.dtype)):
                return False
    for tensors in lists[1:]:
        for a, b in zip(lists[0], tensors):
            if a.shape != b.shape or any(n != 1 and x != y for n, x, y in zip(a.shape, a.stride(), b.stride())):
                return False
    return True


def multi_tensor_apply_launches(tensors, depth):
    """Kernels multi_tensor_apply launches over `tensors` with `depth` lists (MTA_* above)."""
    launches = blocks = held = 0
    max_tensors = MTA_MAX_TENSORS[min(depth, len(MTA_MAX_TENSORS)) - 1]
    for t in tensors:
        chunks = -(-t.numel() // MTA_CHUNK)
        if chunks == 0:
            continue
        held += 1
        for c in range(chunks):
            blocks += 1
            if blocks == MTA_MAX_BLOCKS or (c == chunks - 1 and held == max_tensors):
                launches, blocks = launches + 1, 0
                held = 0 if c == chunks - 1 else 1  # a tensor cut at a full launch carries over
    return launches + (blocks > 0)


def foreach_kernel_bytes(name, args, kwargs, out=None):
    """[bytes moved by each kernel] of a foreach op as CUDA runs it: the fast path's
    multi_tensor_apply kernels (the op's bytes spread evenly over them; a norm adds one kernel that
    reduces the partial sums), or the slow path's kernel per tensor index. `out` (the op's result,
    when known) only sizes the bytes."""
    lists = [a for a in list(args) + list(kwargs.values())
             if isinstance(a, (list, tuple)) and a and all(isinstance(t, torch.Tensor) for t in a)]
    if not lists:
        return [tensor_bytes((args, kwargs, out))]
    n = len(lists[0])
    outputs = [out] if isinstance(out, (list, tuple)) and out and isinstance(out[0], torch.Tensor) else []
    reduction = name in ("_foreach_norm", "_foreach_max")
    in_place = name.endswith("_")
    # read every list, write the result (in place: the first list, written back)
    per_index = [tensor_bytes(([tensors[j] for tensors in lists + outputs] + ([lists[0][j]] if in_place else []),))
                 for j in range(n)]
    depth = len(lists) + (0 if in_place or reduction else 1)
    if foreach_fast_route(lists, same_dtype=not name.startswith("_foreach_copy")):
        launches = multi_tensor_apply_launches(lists[0], depth) + (1 if reduction else 0)
        total = sum(per_index)
        return [total / max(launches, 1)] * max(launches, 1)
    return per_index


def tensor_bytes(tree):
    """Bytes of the tensors in `tree` (an op's inputs and outputs) as memory holds them: a
    broadcast dimension (stride 0) is read once, not once per element it stands for."""
    from torch.utils._pytree import tree_flatten
    total = 0
    for t in tree_flatten(tree)[0]:
        if isinstance(t, torch.Tensor):
            n = 1
            for size, stride in zip(t.shape, t.stride()):
                if stride != 0:
                    n *= size
            total += n * t.element_size()
    return total


def is_linalg(name):
    if name in ("linalg_vector_norm", "linalg_matrix_norm"):
        return False  # reductions, not factorizations
    return name in LINALG_FLOPS or name.startswith(("linalg_", "_linalg_")) or name in (
        "cholesky_solve", "cholesky_inverse", "orgqr", "ormqr", "lu_unpack", "_linalg_check_errors")


def tf32_allowed():
    """Would torch's own CUDA fp32 matmuls use TF32 (allow_tf32 / fp32_precision "tf32")?"""
    setting = getattr(torch.backends.cuda.matmul, "fp32_precision", None)
    if setting is not None and setting != "none":
        return setting == "tf32"
    return torch.backends.cuda.matmul.allow_tf32


def product_precision(dtype, triton):
    """Precision label of a product on a GPU: "triton:tf32x3" / "triton:tf32" / "triton:bf16"
    for a fused kernel, "ieee-fp32" / "tf32" / "bf16" for a torch (cuBLAS) matmul."""
    low = dtype in (torch.bfloat16, torch.float16)
    if triton:
        # tl.dot's precision for fp32 operands: kernels.precision's rule, as products_triton reads it
        return "triton:" + ("bf16" if low else fp32_precision())
    if low:
        return "bf16"
    if dtype == torch.float32:
        return "tf32" if tf32_allowed() else "ieee-fp32"
    return str(dtype).replace("torch.", "")  # float64: CUDA cores at a fraction of fp32


def call_site(packages=("manifolds", "kernels")):
    """"file:line function" of the innermost caller in the first of `packages` found on the
    stack (the algorithm step that asked for an op), or None."""
    for package in packages:
        marker = os.sep + package + os.sep
        frame = sys._getframe(2)
        while frame is not None:
            code = frame.f_code
            if marker in code.co_filename and code.co_filename != step_graph.__file__:  # its host-read watcher
                path = code.co_filename[code.co_filename.rindex(marker) + 1:]
                return f"{path}:{frame.f_lineno} {code.co_name}"
            frame = frame.f_back
    return None


class HostReads(HostReadMode):
    """Counts host reads of device values (`count`): the aten ops they end in (item, bool, float,
    if tensor:) and the Tensor methods that read without one (tolist, numpy, cpu, to("cpu"))."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def host_read(self, _):
        self.count += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.reads_host(func):
            self.host_read(func)
        return func(*args, **(kwargs or {}))


class OpCounter(HostReadMode):
    """Counts aten ops (see the module docstring); `summary()` gives the totals.
    sites=True also sums product and linalg FLOPs, and host syncs, by call site (`call_site`)."""

    def __init__(self, sites=False):
        super().__init__()
        self.record_sites = sites
        self.sites = Counter()           # (call site, precision label or linalg op) -> FLOPs
        self.sync_sites = Counter()      # call site -> host syncs
        self.launch_sites = Counter()    # call site -> kernel launches (torch ops and Triton launches)
        self.kernels = Counter()         # op name -> calls (outside the Triton products)
        self.fused = Counter()           # op name -> calls inside a Triton product (no kernel of their own)
        self.syncs = Counter()
        self.literals = Counter()
        self.flops = Counter()           # precision label -> FLOPs of dense products
        self.products = Counter()        # (op name, precision label) -> calls
        self.linalg = Counter()          # op name -> calls
        self.linalg_flops = Counter()
        self.triton = Counter()          # products_torch function -> calls (= Triton launches)
        self.triton_flops = Counter()    # function -> FLOPs as the torch twin computes them (dense)
        self.triton_executed = Counter()  # function -> FLOPs the Triton kernel computes (upper tiles)
        self.executed = Counter()        # precision label -> FLOPs as the GPU would compute them
        self.triton_extra_kernels = 0    # torch ops the Triton wrappers launch besides the kernel
        self.op_bytes = []               # bytes each memory-bound kernel reads and writes, in program order
        self.op_sites = []               # (sites=True) the call site of each of op_bytes
        self.collectives = []            # (name, bytes sent by this rank)
        # simulated collectives in post order: {name, wire_bytes, posted: progress(), waited: progress()
        # or None (never waited in the step)}; a synchronous one is waited where it is posted
        self.transfers = []
        self.transfer_order = []         # [("post" | "wait", index into transfers)] in program order
        self._triton_depth = 0
        self._triton_dtype = None
        self._paused = 0

    def host_read(self, name):
        """One host sync: an op of SYNC_OPS or a Tensor method of step_graph.HOST_READ_METHODS."""
        if self._paused:
            return
        self.syncs[name] += 1  # counted before it runs: under fake tensors it raises
        if self.record_sites:
            self.sync_sites[call_site()] += 1

    # -- hooks used by triton_attribution and simulated_collectives --------------------------
    @contextlib.contextmanager
    def paused(self):
        """Ops inside are not counted (bookkeeping of the simulation itself)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        memory_bound = not self._paused and self._count(name, args, kwargs)
        out = func(*args, **kwargs)
        if memory_bound:
            # an out= tensor is the output itself: its bytes are written once
            kernels = (foreach_kernel_bytes(name, args, kwargs, out) if name.startswith("_foreach_") else
                       [tensor_bytes((args, {k: v for k, v in kwargs.items() if k != "out"}, out))])
            self.op_bytes.extend(kernels)
            if self.record_sites:
                self.op_sites.extend([call_site()] * len(kernels))
        return out

    def _count(self, name, args, kwargs):
        """Count one aten op; True where it is a kernel of its own that is not a product or a
        factorization (elementwise, reductions, copies: priced by the bytes they move too)."""
        if name in SYNC_OPS:
            self.host_read(name)
            return False
        if name in VIEW_OPS:
            return False
        if name in LITERAL_OPS:
            if args[0].dim() > 0:
                self.literals[name] += 1
                return False
            name = "scalar_tensor"  # `t[i] = 2.0`: on CUDA a 0-dim device tensor, made by a fill kernel
        triton = self._triton_depth > 0
        # a foreach op is one call here but several kernels on CUDA (foreach_kernel_bytes)
        launches = len(foreach_kernel_bytes(name, args, kwargs)) if name.startswith("_foreach_") and not triton else 1
        (self.fused if triton else self.kernels)[name] += launches
        if self.record_sites and not triton:
            self.launch_sites[call_site()] += launches
        if name in PRODUCT_FLOPS:
            label = product_precision(args[0].dtype if not triton else self._triton_dtype, triton)
            flops = PRODUCT_FLOPS[name](*args, **kwargs)
            self.flops[label] += flops
            if not triton:  # a Triton launch adds its executed FLOPs when it returns
                self.executed[label] += flops
            if self.record_sites:
                self.sites[(call_site(), label)] += flops
            self.products[(name, label)] += 1
        elif is_linalg(name):
            self.linalg[name] += 1
            formula = LINALG_FLOPS.get(name)
            if formula is not None:
                flops = formula(*args, **kwargs)
                self.linalg_flops[name] += flops
                if self.record_sites:
                    self.sites[(call_site(), name)] += flops
        return not triton and name not in PRODUCT_FLOPS and not is_linalg(name)

    def progress(self):
        """Where the step stands: the counts so far that the cost model prices as compute."""
        return {"launches": self.launches, "host_syncs": self.sync_count,
                "host_literals": sum(self.literals.values()),
                "flops_executed_by_precision": dict(self.executed), "linalg_flops": dict(self.linalg_flops),
                "memory_ops": len(self.op_bytes)}  # how many of op_bytes (the summary's) precede this point

    def record_post(self, name, wire_bytes):
        self.transfers.append({"name": name, "wire_bytes": wire_bytes, "posted": self.progress(), "waited": None})
        self.transfer_order.append(("post", len(self.transfers) - 1))
        return len(self.transfers) - 1

    def record_wait(self, index):
        self.transfers[index]["waited"] = self.progress()
        self.transfer_order.append(("wait", index))

    # -- results ---------------------------------------------------------------------------
    @property
    def kernel_count(self):
        return sum(self.kernels.values())

    @property
    def sync_count(self):
        return sum(self.syncs.values())

    @property
    def launches(self):
        """Kernel launches on a GPU: torch kernels + Triton launches (+ the wrappers' extras)."""
        return self.kernel_count + sum(self.triton.values()) + self.triton_extra_kernels

    def summary(self, top=20):
        return {
            "kernels": self.kernel_count,
            "kernels_top": dict(self.kernels.most_common(top)),
            "triton_launches": dict(self.triton),
            "triton_extra_kernels": self.triton_extra_kernels,
            "launches": self.launches,
            "ops_fused_into_triton": sum(self.fused.values()),
            "host_syncs": self.sync_count,
            "host_syncs_by_op": dict(self.syncs),
            "host_syncs_by_site": dict(self.sync_sites.most_common()),
            "host_literals": sum(self.literals.values()),
            "flops_by_precision": dict(self.flops),
            "flops_total": sum(self.flops.values()),
            "flops_executed_by_precision": dict(self.executed),
            "products": {f"{name} [{label}]": n for (name, label), n in sorted(self.products.items())},
            "triton_flops": dict(self.triton_flops),
            "triton_flops_executed": dict(self.triton_executed),
            "linalg": dict(self.linalg),
            "linalg_flops": dict(self.linalg_flops),
            "op_bytes": list(self.op_bytes),
            "memory_ops": len(self.op_bytes),
            "op_sites": list(self.op_sites),
            "memory_bytes": sum(self.op_bytes),
            "linalg_syncing_on_cuda": sum(n for name, n in self.linalg.items() if name in CHECKS_INFO),
            "collectives": len(self.collectives),
            "collective_bytes_sent": sum(b for _, b in self.collectives),
            "transfers": [dict(t) for t in self.transfers],
            "transfer_order": [list(event) for event in self.transfer_order],
            "final": self.progress(),
            "flops_by_site": {f"{site} [{label}]": flops for (site, label), flops in self.sites.most_common(top)},
            "launches_by_site": dict(self.launch_sites.most_common()),
        }


# --- Triton attribution ---------------------------------------------------------------------

TRITON_FUNCTIONS = ("matmul_add", "sym_product", "symmetric_gram")
TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SMALL, SMALL_PROBLEM, TILE = 32, 256, 64  # products_triton's small tile and threshold; a typical tuned tile


def upper_fraction(n):
    """Share of an n x n output a symmetric Triton kernel computes: its upper-triangle tiles
    (32-wide below 256, assumed 64-wide above; the autotuner may pick 128)."""
    block = SMALL if n < SMALL_PROBLEM else TILE
    tiles = -(-n // block)
    return tiles * (tiles + 1) / 2 / tiles ** 2


@contextlib.contextmanager
def triton_attribution(counter, module=None):
    """While inside, each call of products_torch.{matmul_add, sym_product, symmetric_gram} on
    a dtype the Triton kernels take counts as one Triton launch on `counter`, and the ops it
    dispatches are attributed to that launch (not counted as kernels of their own)."""
    if module is None:
        from kernels import products_torch as module
    originals = {name: getattr(module, name) for name in TRITON_FUNCTIONS}

    def wrap(name, fn):
        @functools.wraps(fn)
        def counted(*args, **kwargs):
            first = args[0]
            if counter._triton_depth or first.dtype not in TRITON_DTYPES or counter._paused:
                return fn(*args, **kwargs)  # on the GPU this would be torch ops, counted as such
            before = sum(counter.flops.values())
            counter._triton_depth += 1
            counter._triton_dtype = first.dtype
            try:
                out = fn(*args, **kwargs)
            finally:
                counter._triton_depth -= 1
            dense = sum(counter.flops.values()) - before
            counter.triton[name] += 1
            if counter.record_sites:
                counter.launch_sites[call_site()] += 1
            counter.triton_flops[name] += dense
            executed = dense
            if name != "matmul_add":  # symmetric output (q x q for symmetric_gram, m x m for sym_product)
                executed *= upper_fraction(out[0].size(-1) if name == "symmetric_gram" else out.size(-1))
            counter.triton_executed[name] += executed
            counter.executed[product_precision(first.dtype, True)] += executed
            if name == "symmetric_gram" and kwargs.get("want_sumsq", args[6] if len(args) > 6 else False):
                counter.triton_extra_kernels += 1  # the per-tile ||.||^2 slots are summed by torch
            return out
        return counted

    for name, fn in originals.items():
        setattr(module, name, wrap(name, fn))
    twins = [fused_twin(counter, *spec) for spec in FUSED_TWINS]
    try:
        yield counter
    finally:
        for name, fn in originals.items():
            setattr(module, name, fn)
        for restore in twins:
            restore()


def _momentum_kernels(bufs, grads, finite, mu, nesterov, wanted):
    """[bytes] of each launch of kernels.momentum_update's Triton kernel (momentum_triton): SLOTS
    matrices a launch, each moving g and b in, b out and G out where wanted (flags: a byte a
    matrix); None where CUDA would run the twin (kernels.momentum.momentum_update's test)."""
    from kernels.momentum import SLOTS, takes_kernel
    if not all(takes_kernel(b, g, mu) for b, g in zip(bufs, grads)):
        return None  # some to the twin: the whole call counted as torch ops (a conservative count)
    wanted = set(wanted)
    present = [i for i in range(len(bufs)) if bufs[i].numel()]  # empty ones are skipped
    return [sum(grads[i].numel() * grads[i].element_size() + bufs[i].numel() * 4 * (3 if i in wanted else 2)
                for i in present[at:at + SLOTS]) for at in range(0, len(present), SLOTS)]


def _moment_bound_kernels(t, f, m, log_scale, q, squarings):
    """[bytes] of kernels.bound_from_moments's Triton launch: four (n,) vectors in, one out."""
    from kernels import vectors_take_triton
    if not vectors_take_triton(t, f, m, log_scale):
        return None
    return [5 * t.numel() * t.element_size()] if t.numel() else []


def _signal_kernels(g2, m2, y2, probes, tol):
    """[bytes] of kernels.signal_from_sums's Triton launch: three (n,) vectors in, n flags out."""
    from kernels import vectors_take_triton
    if not vectors_take_triton(g2, m2, y2):
        return None
    return [g2.numel() * (3 * g2.element_size() + 1)] if g2.numel() else []


# torch twins of the elementwise Triton kernels: (module, function, kernel bytes of a call or None)
FUSED_TWINS = (("kernels.momentum", "momentum_update_torch", _momentum_kernels),
               ("kernels.moment_bound", "bound_from_moments_torch", _moment_bound_kernels),
               ("kernels.signal", "signal_from_sums_torch", _signal_kernels))


def fused_twin(counter, module_name, name, kernel_bytes):
    """Patch module.name (the torch twin of an elementwise Triton kernel) so that a call counts as
    the kernel's launches and bytes, its own ops uncounted; returns the function that restores it.
    Where kernel_bytes says CUDA would run the twin too (None), its ops count as they are."""
    import importlib
    module = importlib.import_module(module_name)
    twin = getattr(module, name)

    @functools.wraps(twin)
    def counted(*args):
        kernels = None if counter._triton_depth or counter._paused else kernel_bytes(*args)
        if kernels is None:
            return twin(*args)
        with counter.paused():
            out = twin(*args)
        site = call_site() if counter.record_sites else None
        for moved in kernels:
            counter.triton[name.removesuffix("_torch")] += 1
            counter.op_bytes.append(moved)
            if counter.record_sites:
                counter.launch_sites[site] += 1
                counter.op_sites.append(site)
        return out

    setattr(module, name, counted)
    return lambda: setattr(module, name, twin)


# --- Simulated collectives ------------------------------------------------------------------

class _Recorded:
    """The handle of a simulated async collective: its first wait() is recorded on the counter
    (where the step's compute waits for the transfer); is_completed() says True."""

    def __init__(self, counter, index):
        self.counter, self.index, self.waited = counter, index, False

    def wait(self, *_, **__):
        if not self.waited:
            self.waited = True
            self.counter.record_wait(self.index)
        return True

    def is_completed(self):
        return True


def _nbytes(t):
    return t.numel() * t.element_size()


@contextlib.contextmanager
def simulated_collectives(counter, world_size=None):
    """torch.distributed's all_gather / all_gather_into_tensor / all_gather_single / all_reduce /
    broadcast / reduce_scatter(_tensor) / all_to_all_single as local no-ops (output buffers zeroed)
    that record on `counter` the bytes this rank puts in (its input tensor(s)) and the bytes it puts
    on its link (a ring's: (n - 1) x its input for an all-gather of n ranks, (n - 1) / n of the input
    for a reduce-scatter, 2 (n - 1) / n for an all-reduce, the parts for the others for an
    all-to-all), n read from the buffers' sizes, else `world_size`. Each call is posted where the
    step stands (OpCounter.progress); an async call's handle records its wait, a synchronous call
    waits where it is posted (OpCounter.transfers)."""
    patched = {}
    default_n = world_size or 1

    def record(name, nbytes, wire, async_op):
        counter.collectives.append((name, nbytes))
        index = counter.record_post(name, wire)
        if async_op:
            return _Recorded(counter, index)
        counter.record_wait(index)
        return None

    def all_gather(tensor_list, tensor, group=None, async_op=False):
        with counter.paused():
            for t in tensor_list:
                t.zero_()
        return record("all_gather", _nbytes(tensor), (len(tensor_list) - 1) * _nbytes(tensor), async_op)

    def into_tensor(name):
        def all_gather_into_tensor(output, input, group=None, async_op=False):
            with counter.paused():
                output.zero_()
            n = max(1, output.numel() // max(1, input.numel()))
            return record(name, _nbytes(input), (n - 1) * _nbytes(input), async_op)
        return all_gather_into_tensor

    def all_reduce(tensor, *args, async_op=False, **kwargs):
        n = default_n
        return record("all_reduce", _nbytes(tensor), 2 * (n - 1) / n * _nbytes(tensor), async_op)

    def broadcast(tensor, *args, async_op=False, **kwargs):
        return record("broadcast", _nbytes(tensor), _nbytes(tensor), async_op)

    def reduce_scatter(output, input_list, *args, async_op=False, **kwargs):
        nbytes, n = sum(_nbytes(t) for t in input_list), max(1, len(input_list))
        return record("reduce_scatter", nbytes, (n - 1) / n * nbytes, async_op)

    def reduce_scatter_tensor(output, input, *args, async_op=False, **kwargs):
        n = max(1, input.numel() // max(1, output.numel()))
        return record("reduce_scatter_tensor", _nbytes(input), (n - 1) / n * _nbytes(input), async_op)

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                          async_op=False):
        with counter.paused():
            output.zero_()
        # this rank's own part stays local; which part that is the simulation does not know: the
        # parts are taken as equal, (n - 1) / n of the input on the wire
        n = len(input_split_sizes) if input_split_sizes else default_n
        wire = (n - 1) / max(1, n) * _nbytes(input)
        return record("all_to_all_single", _nbytes(input), wire, async_op)

    fakes = {"all_gather": all_gather, "all_gather_into_tensor": into_tensor("all_gather_into_tensor"),
             "all_gather_single": into_tensor("all_gather_single"),
             "all_reduce": all_reduce, "broadcast": broadcast,
             "reduce_scatter": reduce_scatter, "reduce_scatter_tensor": reduce_scatter_tensor,
             "all_to_all_single": all_to_all_single}
    for name, fake in fakes.items():
        if hasattr(dist, name):
            patched[name] = getattr(dist, name)
            setattr(dist, name, fake)
    try:
        yield counter
    finally:
        for name, fn in patched.items():
            setattr(dist, name, fn)
