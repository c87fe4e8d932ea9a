"""kernels/momentum.py: the optimizer's momentum update, the Triton kernel (in the interpreter on a
CPU) against its torch twin and an independent float64 statement of the rule, a non-finite
gradient leaving the momentum as it was, the kernel compiled for the GPUs (kernels/aot.py), and
the optimizer's momenta unchanged by the kernel's dispatch."""
import math

import pytest
import torch

from kernels import aot
from kernels.momentum import SLOTS, momentum_update, momentum_update_torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # bench/gpu_check.sh runs this file on a GPU
cpu_only = pytest.mark.skipif(DEVICE == "cuda", reason="CPU work (builds): CI runs it")
# more matrices than a launch's slots (two launches, the second part-filled), of sizes that end
# inside a block, one of a single entry, one larger than a block
SHAPES = [(37, 5), (100, 30), (2048, 3), (1, 1), (64, 64), (10, 10), (3, 1500), (5, 5), (7, 9), (300, 7)]


def case(seed, bad=(2, 8)):
    """(bufs, grads, finite): fp32 matrices, the gradients of `bad` with a NaN or an inf."""
    g = torch.Generator().manual_seed(seed)
    grads = [torch.randn(s, generator=g).to(DEVICE) for s in SHAPES]
    bufs = [torch.randn(s, generator=g).to(DEVICE) for s in SHAPES]
    for k, i in enumerate(bad):
        grads[i].view(-1)[(7 * k) % grads[i].numel()] = math.nan if k % 2 == 0 else math.inf
    finite = torch.stack(torch._foreach_norm(grads, math.inf)).isfinite()
    return bufs, grads, finite


def rule(buf, grad, ok, mu, nesterov):
    """The update in float64, written out: (new buf, G)."""
    buf, grad = buf.double(), grad.double()
    if not ok:
        return buf, mu * buf if nesterov else buf
    buf = mu * buf + grad
    return buf, grad + mu * buf if nesterov else buf


def test_slots_cover_more_than_one_launch():
    assert len(SHAPES) > SLOTS and len(SHAPES) % SLOTS != 0


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("checked", [True, False])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_the_update_follows_the_rule_and_keeps_a_nonfinite_momentum_exactly(backend, checked, nesterov):
    bufs, grads, finite = case(0) if checked else case(0, bad=())
    before = [b.clone() for b in bufs]
    wanted = [0, 2, 3, 8, 9]  # a strict subset, across both launches, non-finite ones among them
    out = momentum_update(bufs, grads, finite if checked else None, 0.95, nesterov, wanted, backend=backend)
    assert len(out) == len(wanted)
    for i, (old, grad) in enumerate(zip(before, grads)):
        ok = bool(finite[i]) if checked else True
        want_buf, want_G = rule(old, grad, ok, 0.95, nesterov)
        if not ok:
            assert torch.equal(bufs[i], old)  # bit for bit: no mu * buf / mu round trip
        torch.testing.assert_close(bufs[i].double(), want_buf, rtol=1e-6, atol=1e-6)
        if i in wanted:
            G = out[wanted.index(i)]
            assert G.data_ptr() != bufs[i].data_ptr()  # the solver's input is not the state itself
            torch.testing.assert_close(G.double(), want_G, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("nesterov", [True, False])
def test_the_kernel_matches_its_torch_twin(nesterov):
    """The buffers bit for bit (b mu + g, rounded twice in both); G within a rounding: the twin's
    g + mu b is one fused multiply-add on CPUs and GPUs, which the interpreter rounds twice."""
    bufs, grads, finite = case(1)
    twin_bufs = [b.clone() for b in bufs]
    wanted = list(range(len(SHAPES)))
    got = momentum_update(bufs, grads, finite, 0.9, nesterov, wanted, backend="triton")
    want = momentum_update_torch(twin_bufs, grads, finite, 0.9, nesterov, wanted)
    for a, b in zip(bufs, twin_bufs):
        assert torch.equal(a, b) if DEVICE == "cpu" else torch.allclose(a, b, rtol=1e-6, atol=1e-7)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=2e-7, atol=1e-7)


def test_non_contiguous_matrices_take_the_twin_and_the_others_the_kernel(monkeypatch):
    """A column-major gradient (a transposed view's) goes to the twin, not to a kernel that reads
    it as rows; the other matrices still take the kernel, each with its own finite flag."""
    from kernels import momentum_triton
    bufs, grads, finite = case(2)
    grads[1] = grads[1].t().contiguous().t()  # same values, column-major
    twin_bufs = [b.clone() for b in bufs]
    launched = []
    kernel = momentum_triton.momentum_update
    monkeypatch.setattr(momentum_triton, "momentum_update", lambda b, *a: launched.append(len(b)) or kernel(b, *a))
    got = momentum_update(bufs, grads, finite, 0.9, True, [1, 2, 9], backend="triton")
    want = momentum_update_torch(twin_bufs, grads, finite, 0.9, True, [1, 2, 9])
    assert launched == [len(SHAPES) - 1]
    for a, b in zip(bufs, twin_bufs):
        assert torch.equal(a, b) if DEVICE == "cpu" else torch.allclose(a, b, rtol=1e-6, atol=1e-7)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=2e-7, atol=1e-7)


@cpu_only
def test_the_kernel_compiles_for_both_gpus():
    """The kernel as the wrapper launches it (CHECK on and off, Nesterov on and off, fp32 and bf16
    gradients), on sm_80 and sm_90, without register spills."""
    from kernels import momentum_triton
    names = momentum_triton._momentum_kernel.arg_names
    specs = []
    for target in aot.TARGETS:
        for grad_dtype in ("fp32", "bf16"):
            for check in (True, False):
                for nesterov in (True, False):
                    signature = {}
                    for name in names:
                        if name in ("CHECK", "NESTEROV", "BLOCK"):
                            signature[name] = "constexpr"
                        elif name[0] == "G" and name[1:].isdigit():
                            signature[name] = f"*{grad_dtype}"
                        elif name[0] in "BO" and name[1:].isdigit():
                            signature[name] = "*fp32"
                        elif name[0] == "F" and name[1:].isdigit():
                            signature[name] = "*u8"
                        elif name == "mu":
                            signature[name] = "fp32"
                        else:
                            signature[name] = "i32"
                    specs.append(dict(module="kernels.momentum_triton", function="_momentum_kernel",
                                      signature=signature,
                                      constexprs={"CHECK": check, "NESTEROV": nesterov, "BLOCK": momentum_triton.BLOCK},
                                      target=target, num_warps=4, num_stages=2, dtype=grad_dtype))
    for result in aot.run(specs, n_jobs=2, builder=aot.build_function):
        assert result["ok"], f"{result['target']} {result['dtype']}: {result.get('error')}"
        assert result["spill_stores"] == 0, result


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_empty_matrices_are_skipped_and_the_flags_stay_with_their_matrices(backend):
    """An FSDP shard of no rows among the matrices (it needs no update, and its storage may be a null
    pointer): the others keep their own finite flags, a non-finite one after the empty one included."""
    g = torch.Generator().manual_seed(3)
    shapes = [(5, 4), (0, 4), (6, 3), (0, 7), (9, 2)] + [(3, 3)] * SLOTS
    grads = [torch.randn(s, generator=g).to(DEVICE) for s in shapes]
    bufs = [torch.randn(s, generator=g).to(DEVICE) for s in shapes]
    grads[2][1, 1] = math.nan
    finite = torch.stack([torch.isfinite(x).all() for x in grads])
    before = [b.clone() for b in bufs]
    out = momentum_update(bufs, grads, finite, 0.5, False, [1, 2, 4], backend=backend)
    assert out[0].shape == (0, 4)
    assert torch.equal(bufs[2], before[2])  # its gradient is not finite: kept
    for i in (0, 4, 5, len(shapes) - 1):
        torch.testing.assert_close(bufs[i], 0.5 * before[i] + grads[i])
    torch.testing.assert_close(out[2], bufs[4])


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_bf16_gradients_are_read_as_they_are(backend):
    """A bf16 gradient (a bf16 model's, or FSDP's bf16 reduction) updates the fp32 momentum as its
    fp32 value would: the kernel reads it without an fp32 copy, the twin makes one."""
    bufs, grads, finite = case(4)
    low = [g.to(torch.bfloat16) for g in grads]
    as_fp32 = [g.float() for g in low]
    twin_bufs = [b.clone() for b in bufs]
    got = momentum_update(bufs, low, finite, 0.9, True, [0, 5], backend=backend)
    want = momentum_update_torch(twin_bufs, as_fp32, finite, 0.9, True, [0, 5])
    for a, b in zip(bufs, twin_bufs):
        assert torch.equal(a, b) if DEVICE == "cpu" else torch.allclose(a, b, rtol=1e-6, atol=1e-7)
    for a, b in zip(got, want):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=2e-7, atol=1e-7)


def test_the_gpu_benchs_momentum_case_compares_like_with_like(monkeypatch):
    """bench/kernels.py's momentum rows (timed on a GPU by bench/gpu_check.sh): each backend updates
    buffers of its own from the same start, so the reported error compares one update with the
    same update (with shared buffers the second backend's call started from the first's result)."""
    from bench import kernels as bench_kernels
    monkeypatch.setattr(bench_kernels, "DEVICE", DEVICE)
    args = bench_kernels.parse_args(["--ops", "momentum"])
    for dtype in bench_kernels.DTYPES.values():
        _, _, fns = bench_kernels.cases("momentum", (3, 16, 40), dtype, args)
        results = {backend: fn() for backend, fn in fns.items()}
        assert bench_kernels.relative_error(results["triton"], results["torch"]) < 1e-6


def test_the_optimizer_keeps_the_same_momenta_on_the_kernel():
    """ManifoldMuon with backend="triton" (the interpreter here, CUDA on a GPU) against backend
    "torch": after two steps, one of them with a NaN gradient, every momentum buffer equal (bit for
    bit in the interpreter, which rounds b mu + g twice as the twin does) and the NaN matrix's
    buffer as it was."""
    from manifolds import ManifoldMuon, project_to_manifold
    g = torch.Generator().manual_seed(5)
    shapes = [((40, 12), "stiefel"), ((48, 12), "dgram"), ((12, 40), "dgram"), ((16, 16), "none")]

    def build(backend):
        params = [torch.nn.Parameter((project_to_manifold(torch.randn(s, generator=torch.Generator().manual_seed(i)), m)
                                      if m != "none" else torch.randn(s, generator=torch.Generator().manual_seed(i)))
                                     .contiguous())  # a parameter as a module holds it
                  for i, (s, m) in enumerate(shapes)]
        groups = [{"params": [p], "manifold": m} for p, (_, m) in zip(params, shapes)]
        return params, ManifoldMuon(groups, lr=0.05, backend=backend)

    runs = {backend: build(backend) for backend in ("torch", "triton")}
    grads = [[torch.randn(s, generator=g) for s, _ in shapes] for _ in range(2)]
    grads[1][1][3, 4] = math.nan
    kept = {}
    for step, step_grads in enumerate(grads):
        for backend, (params, opt) in runs.items():
            for p, grad in zip(params, step_grads):
                p.grad = grad.clone()
            if step == 1:
                kept[backend] = opt.state[params[1]]["momentum_buffer"].clone()
            opt.step()
    (tp, topt), (kp, kopt) = runs["torch"], runs["triton"]
    assert all(p.is_contiguous() for p in kp)  # the kernel takes every matrix (not the twin for all)
    for a, b in zip(tp, kp):
        assert torch.equal(topt.state[a]["momentum_buffer"], kopt.state[b]["momentum_buffer"])
    assert torch.equal(kopt.state[kp[1]]["momentum_buffer"], kept["triton"])
