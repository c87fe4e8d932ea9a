"""The momentum update of ManifoldMuon's matrices, all of a group's in a few launches.

For each matrix i, with g_i its gradient, b_i its fp32 momentum buffer and ok_i whether g_i is
finite (None: not checked, all taken as finite):

    g'  = g if ok else 0          (a non-finite gradient counts as no gradient)
    b  <- b * (mu if ok else 1) + g'   (so a non-finite step leaves b as it was, bit for bit)
    G   = g' + mu b  (Nesterov)  or  b          (written only where `wanted`)

The torch twin (`momentum_update_torch`) is one `where` per checked matrix and three foreach ops.
On CUDA the per-matrix factor (mu or 1) is a list of 0-dim tensors, which foreach ops take on
their slow path, a kernel per matrix; so the twin launches about 2 kernels a matrix (GPT-2 small's
48: 48 wheres, 48 products, then multi_tensor_apply's few) and moves 28 bytes an entry (the where
8, the scaling 8, the sum 12), 40 where G is wanted (its sum 12 more). The Triton kernel
(kernels/momentum_triton.py) makes the whole update one pass over each matrix, SLOTS matrices a
launch: 12 bytes an entry (g and b read, b written), 16 where G is wanted, and 6 launches for
GPT-2 small's 48 matrices. A graph-captured step replays it like any other kernel: the
matrices' addresses are kernel arguments, not a table on the device.
"""
import torch

SLOTS = 8  # matrices per Triton launch (each its pointers, size and first block among the arguments)


def momentum_update_torch(bufs, grads, finite, mu, nesterov, wanted):
    """The update above in torch ops. bufs and grads fp32; bufs are updated in place, grads not written.
    finite: a (n,) bool tensor or None; wanted: indices whose G is returned, in order."""
    if finite is not None:
        zero = finite.new_zeros((), dtype=grads[0].dtype)  # one tensor, not a scalar_tensor launch per matrix
        grads = [torch.where(ok, g, zero) for g, ok in zip(grads, finite.unbind(0))]
        torch._foreach_mul_(bufs, list(torch.where(finite, mu, 1.0).unbind(0)))
    else:
        torch._foreach_mul_(bufs, mu)
    torch._foreach_add_(bufs, grads)
    if not wanted:
        return []
    grads, bufs = [grads[i] for i in wanted], [bufs[i] for i in wanted]
    return torch._foreach_add(grads, bufs, alpha=mu) if nesterov else torch._foreach_mul(bufs, 1.0)


def takes_kernel(buf, grad, mu):
    """Whether the Triton kernel takes this matrix: contiguous, an fp32 buffer, a float gradient, a
    momentum that is a number (bench.op_count prices by the same test)."""
    from kernels import TRITON_DTYPES
    return (isinstance(mu, (int, float)) and buf.is_contiguous() and grad.is_contiguous()
            and buf.dtype == torch.float32 and grad.dtype in TRITON_DTYPES)


def momentum_update(bufs, grads, finite, mu, nesterov, wanted, backend="auto"):
    """[G of each wanted matrix] after the update above, by `backend` (kernels.BACKENDS): the
    Triton kernel where it is selected, for the matrices it takes (contiguous, an fp32 buffer, a
    float gradient), and the torch twin for the rest (a transposed view's buffer, say)."""
    from kernels import triton_selected  # the same dispatch as the products
    if not bufs:
        return []
    fused = ([i for i, (b, g) in enumerate(zip(bufs, grads)) if takes_kernel(b, g, mu)]
             if triton_selected(backend, bufs[0]) else [])
    rest = sorted(set(range(len(bufs))) - set(fused))
    out = {}
    for part, run in ((fused, _triton), (rest, _twin)):
        if not part:
            continue
        flags = None if finite is None else finite if len(part) == len(bufs) else finite[part]
        where = {i: k for k, i in enumerate(part)}
        got = run([bufs[i] for i in part], [grads[i] for i in part], flags, mu, nesterov,
                  [where[i] for i in wanted if i in where])
        out.update(zip([i for i in wanted if i in where], got))
    return [out[i] for i in wanted]


def _triton(bufs, grads, finite, mu, nesterov, wanted):
    from kernels import momentum_triton
    return momentum_triton.momentum_update(bufs, grads, finite, float(mu), nesterov, wanted)


def _twin(bufs, grads, finite, mu, nesterov, wanted):
    # fp32 copies of bf16 or fp16 gradients (the kernel reads them as they are: 6 bytes an entry
    # and a launch a matrix fewer)
    return momentum_update_torch(bufs, [g.float() for g in grads], finite, mu, nesterov, wanted)
