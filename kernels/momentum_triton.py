"""Triton kernel of kernels/momentum.py: the momentum update of up to SLOTS matrices a launch.

Grid: the blocks of BLOCK entries of the launch's matrices, one after another. A program finds
its matrix by comparing its block index with the matrices' first blocks (scalar branches over
the SLOTS argument sets, unrolled at compile time), reads g, b and the matrix's finite flag, and
writes b and (where wanted) G in one pass. Unused slots repeat the last matrix with no blocks.
Under the Triton interpreter the same arithmetic runs in fp32 (g is cast on load either way).
"""
import torch
import triton
import triton.language as tl

from kernels.momentum import SLOTS

BLOCK = 1024


@triton.jit
def _update(Gr, Bf, Out, Flag, n, block, mu, WANT, CHECK: tl.constexpr, NESTEROV: tl.constexpr,
            BLOCK: tl.constexpr):
    offs = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(Gr + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(Bf + offs, mask=mask, other=0.0)
    if CHECK:  # the matrix's flag: a non-finite gradient counts as none, and the momentum stays
        ok = tl.load(Flag) != 0
        g = tl.where(ok, g, 0.0)
        b = b * tl.where(ok, mu, 1.0) + g
    else:
        b = b * mu + g
    tl.store(Bf + offs, b, mask=mask)
    if WANT:
        if NESTEROV:
            out = tl.fma(b, mu, g)  # one rounding, as torch.add(g, b, alpha=mu) on a CPU or GPU
        else:
            out = b
        tl.store(Out + offs, out, mask=mask)


@triton.jit
def _momentum_kernel(G0, B0, O0, F0, N0, G1, B1, O1, F1, N1, G2, B2, O2, F2, N2, G3, B3, O3, F3, N3,
                     G4, B4, O4, F4, N4, G5, B5, O5, F5, N5, G6, B6, O6, F6, N6, G7, B7, O7, F7, N7,
                     S1, S2, S3, S4, S5, S6, S7, wanted, mu,
                     CHECK: tl.constexpr, NESTEROV: tl.constexpr, BLOCK: tl.constexpr):
    # slot i: gradient, buffer, output, finite flag (a byte), size; S_i its first block (slot 0's is
    # block 0); wanted: a bit per slot
    pid = tl.program_id(0)
    slot = ((pid >= S1).to(tl.int32) + (pid >= S2).to(tl.int32) + (pid >= S3).to(tl.int32) + (pid >= S4).to(tl.int32)
            + (pid >= S5).to(tl.int32) + (pid >= S6).to(tl.int32) + (pid >= S7).to(tl.int32))
    start = tl.where(pid >= S7, S7, tl.where(pid >= S6, S6, tl.where(pid >= S5, S5, tl.where(
        pid >= S4, S4, tl.where(pid >= S3, S3, tl.where(pid >= S2, S2, tl.where(pid >= S1, S1, 0)))))))
    block = pid - start
    want = ((wanted >> slot) & 1) != 0
    if slot == 0:
        _update(G0, B0, O0, F0, N0, block, mu, want, CHECK, NESTEROV, BLOCK)
    elif slot == 1:
        _update(G1, B1, O1, F1, N1, block, mu, want, CHECK, NESTEROV, BLOCK)
    elif slot == 2:
        _update(G2, B2, O2, F2, N2, block, mu, want, CHECK, NESTEROV, BLOCK)
    elif slot == 3:
        _update(G3, B3, O3, F3, N3, block, mu, want, CHECK, NESTEROV, BLOCK)
    elif slot == 4:
        _update(G4, B4, O4, F4, N4, block, mu, want, CHECK, NESTEROV, BLOCK)
    elif slot == 5:
        _update(G5, B5, O5, F5, N5, block, mu, want, CHECK, NESTEROV, BLOCK)
    elif slot == 6:
        _update(G6, B6, O6, F6, N6, block, mu, want, CHECK, NESTEROV, BLOCK)
    else:
        _update(G7, B7, O7, F7, N7, block, mu, want, CHECK, NESTEROV, BLOCK)


def momentum_update(bufs, grads, finite, mu, nesterov, wanted):
    """kernels.momentum.momentum_update on contiguous tensors: [G of each wanted matrix]."""
    wanted_set = set(wanted)
    outs = {i: torch.empty_like(bufs[i]) for i in wanted}
    flags = finite.view(torch.uint8) if finite is not None else None
    # empty matrices (an FSDP shard of no rows) need no update, and their storage may be a null pointer
    present = [i for i in range(len(bufs)) if bufs[i].numel()]
    for at in range(0, len(present), SLOTS):
        idx = present[at:at + SLOTS]
        args, starts, total, mask = [], [], 0, 0
        for slot in range(SLOTS):
            i = idx[min(slot, len(idx) - 1)]  # an unused slot repeats the last matrix, with no blocks
            n = bufs[i].numel() if slot < len(idx) else 0
            if slot:
                starts.append(total)
            # the flag as a view at its offset (no launch); without flags the buffer stands in, unread
            args += [grads[i], bufs[i], outs.get(i, bufs[i]), flags[i:] if flags is not None else bufs[i], n]
            total += triton.cdiv(n, BLOCK)
            if slot < len(idx) and i in wanted_set:
                mask |= 1 << slot
        _momentum_kernel[(total,)](*args, *starts, mask, mu, CHECK=flags is not None, NESTEROV=bool(nesterov),
                                   BLOCK=BLOCK, num_warps=4)
    return [outs[i] for i in wanted]
