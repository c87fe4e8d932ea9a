"""Time the fused Triton kernels against their torch twins on GPT-2-small banks (needs a CUDA GPU).

    python -m bench.kernels                       # the table below, on the current GPU
    python -m bench.kernels --out results.json    # also one JSON row per measurement

Banks are the stacked same-shape Muon matrices of GPT-2 small (12 layers):
attn.c_proj 12 x 768x768, attn.c_attn 12 x 768x2304, mlp 24 x 768x3072 (c_fc and c_proj).

    msign        Polar Express + Newton-Schulz on the wide orientation; both backends run the same
                 coefficients and iteration count (plain Muon's, manifolds.plan.MUON_STEPS, unless changed)
    project      ADMM's tangent projection A - W P(W^T A + A^T W) / (d_i^2 + d_j^2) (tall W, A)
    gram         the Gram-space kernels of every ADMM answer: H = P(W^T A + A^T W) with ||H||_F^2
                 (the residual), then the multiplier correction P(W^T Y + Y^T W) / (2 (d_i^2 + d_j^2))
    momentum     the momentum update of the bank's matrices as separate tensors (kernels.momentum_update:
                 finite flags, Nesterov, every G wanted); memory-bound: its TF/s columns count 2 FLOPs
                 an entry, and the target is against the torch twin's where + slow-path foreach ops

DGram (the diagonal projection and the division included; Stiefel does a subset). Each case
is timed twice after a warm-up call (compilation and autotuning excluded): "eager", launched
from Python as the optimizer launches it (triton.testing.do_bench, median), which includes any
host launch overhead the GPU cannot hide; and "graph", replayed from a CUDA graph
(do_bench_cudagraph, median), which is the device time alone. TFLOP/s (graph times) counts the
multiply-adds each backend executes: the Triton Gram products compute half the tiles.
"err" is the largest difference from the torch result relative to its largest entry.
"""
import argparse
import platform
import sys

import torch

import kernels
from bench.results import Results
from kernels.matrix_sign import NEWTON_SCHULZ, polar_express_coefficients
from manifolds.plan import MUON_STEPS

BANKS = {"attn.c_proj": (12, 768, 768), "attn.c_attn": (12, 768, 2304), "mlp": (24, 768, 3072)}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
OPS = ("msign", "project", "gram", "momentum")
DEVICE = "cuda"
TARGETS = {"msign": 1.3, "project": 2.0, "gram": 2.0, "momentum": 2.0}  # speedups the fused kernels should reach
# (bf16 msign; fused tangent ops; the momentum kernel: one pass and 1/8 of the launches)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", default=",".join(OPS), help=f"comma-separated subset of {','.join(OPS)}")
    p.add_argument("--banks", default=",".join(BANKS), help=f"comma-separated subset of {','.join(BANKS)}")
    p.add_argument("--dtypes", default="bf16,fp32", help="comma-separated subset of bf16,fp32")
    p.add_argument("--steps", type=int, default=MUON_STEPS[0], help="Polar Express iterations per msign")
    p.add_argument("--polish-steps", type=int, default=MUON_STEPS[1], help="Newton-Schulz iterations per msign")
    p.add_argument("--rep-ms", type=int, default=100, help="measuring time per case and mode")
    p.add_argument("--out", default=None, help="write the rows as JSON here (rewritten after each row)")
    return p.parse_args(argv)


def msign_flops(bank, steps, polish_steps, fused):
    """Multiply-adds x 2 of one msign on a (b, m, n) wide bank."""
    b, m, n = bank
    gram = m * m * n if fused else 2 * m * m * n          # X X^T: upper tiles only when fused
    square = m ** 3 if fused else 2 * m ** 3              # S S^T
    apply = 2 * m * m * n                                 # B X
    cubic = sum(1 for _, _, c in polar_express_coefficients(steps) if c != 0.0)
    per_step = (steps + polish_steps) * (gram + apply) + cubic * square
    assert NEWTON_SCHULZ[2] == 0.0  # polish steps have no S^2 term
    return b * per_step


def cases(op, bank, dtype, args):
    """(flops_torch, flops_triton, {backend: fn}) for one measurement."""
    b, m, n = bank
    generator = torch.Generator(device=DEVICE).manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, device=DEVICE, generator=generator).to(dtype)

    if op == "msign":
        X = randn(b, m, n)
        fns = {backend: (lambda backend=backend: kernels.msign(X, args.steps, args.polish_steps, backend))
               for backend in ("torch", "triton")}
        return (msign_flops(bank, args.steps, args.polish_steps, False),
                msign_flops(bank, args.steps, args.polish_steps, True), fns)
    if op == "momentum":  # fp32 buffers; gradients in the dtype of the row
        grads = [randn(n, m) for _ in range(b)]
        start = [torch.randn(n, m, device=DEVICE, generator=generator) for _ in range(b)]
        bufs = {backend: [x.clone() for x in start] for backend in ("torch", "triton")}  # updated in place:
        finite = torch.ones(b, dtype=torch.bool, device=DEVICE)                        # one state each
        fns = {backend: (lambda backend=backend: kernels.momentum_update(bufs[backend], grads, finite, 0.95, True,
                                                                          list(range(b)), backend))
               for backend in ("torch", "triton")}
        return 2 * b * m * n, 2 * b * m * n, fns
    p, q = n, m  # tall orientation: W, A are (b, n, m)
    Q = torch.linalg.qr(torch.randn(b, p, q, device=DEVICE, generator=generator)).Q
    W = (Q * torch.linspace(0.5, 2.0, q, device=DEVICE)).to(dtype)  # on DGram, spread column norms
    A = randn(b, p, q)
    d2 = W.float().square().sum(dim=-2).to(dtype)
    if op == "project":
        fns = {backend: (lambda backend=backend: kernels.tangent_projection(W, A, "dgram", d2, backend))
               for backend in ("torch", "triton")}
        flops = 4 * b * p * q * q
        return flops, flops, fns
    Y = randn(b, p, q)

    def gram(backend):
        H, sumsq = kernels.tangent_residual(W, A, "dgram", backend, with_norm=True)
        return kernels.preconditioned(W, Y, "dgram", d2, 0.5, backend), sumsq

    flops = 4 * b * p * q * q
    return flops, flops, {backend: (lambda backend=backend: gram(backend)) for backend in ("torch", "triton")}


def relative_error(fused, reference):
    if isinstance(fused, (tuple, list)):
        return max(relative_error(f, r) for f, r in zip(fused, reference))
    fused, reference = fused.double(), reference.double()
    return float((fused - reference).abs().max() / reference.abs().max().clamp_min(1e-30))


def measure(fns, rep_ms):
    """{mode: {backend: ms}} for the eager and the CUDA-graph mode."""
    from triton.testing import do_bench, do_bench_cudagraph
    return {"eager": {k: do_bench(fn, warmup=25, rep=rep_ms, return_mode="median") for k, fn in fns.items()},
            "graph": {k: do_bench_cudagraph(fn, rep=rep_ms, return_mode="median") for k, fn in fns.items()}}


def fp32_dot_precision():
    """What the fp32 kernels' tl.dot uses (tf32 or tf32x3), as the kernels decide it."""
    try:
        from kernels import products_triton
        return products_triton.fp32_precision()
    except Exception as err:  # the env line must not stop the bench
        return f"unknown ({type(err).__name__}: {err})"


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/kernels.py needs a CUDA GPU: it times the Triton kernels against torch on the "
              "device. Nothing to measure here.")
        return 0
    import triton

    env = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "python": platform.python_version(),
           "fp32_dot_precision": fp32_dot_precision(),
           "msign_steps": args.steps, "polish_steps": args.polish_steps}
    print(", ".join(f"{k} {v}" for k, v in env.items()))
    header = (f"{'op':7} {'bank':11} {'shape':>12} {'dtype':5} | {'eager ms torch':>14} {'triton':>7} "
              f"{'speedup':>7} | {'graph ms torch':>14} {'triton':>7} {'speedup':>7} | "
              f"{'TF/s torch':>10} {'triton':>6} | {'target':>6} {'err':>7}")
    print(header)
    print("-" * len(header))
    out = Results(args.out, env=env, rows=[])
    # dtype outermost: under a time limit all rows of the first dtype (bf16) come first
    for dtype_name in args.dtypes.split(","):
        for op in args.ops.split(","):
            for bank_name in args.banks.split(","):
                bank = BANKS[bank_name]
                try:
                    flops_torch, flops_triton, fns = cases(op, bank, DTYPES[dtype_name], args)
                    results = {backend: fn() for backend, fn in fns.items()}  # warm-up: compile, autotune
                    torch.cuda.synchronize(DEVICE)
                    ms = measure(fns, args.rep_ms)
                except Exception as err:  # one failing case (a compile error, say) spares the others
                    error = f"{type(err).__name__}: {err}"
                    out.append("rows", dict(op=op, bank=bank_name, dtype=dtype_name, error=error))
                    print(f"{op:7} {bank_name:11} {dtype_name:5} FAILED {error}", flush=True)
                    continue
                target = TARGETS[op] if op != "msign" or dtype_name == "bf16" else None
                row = dict(op=op, bank=bank_name, shape=list(bank), dtype=dtype_name, target=target,
                           eager_ms=ms["eager"], graph_ms=ms["graph"],
                           eager_speedup=ms["eager"]["torch"] / ms["eager"]["triton"],
                           graph_speedup=ms["graph"]["torch"] / ms["graph"]["triton"],
                           tflops={"torch": flops_torch / ms["graph"]["torch"] / 1e9,
                                   "triton": flops_triton / ms["graph"]["triton"] / 1e9},
                           max_rel_err=relative_error(results["triton"], results["torch"]))
                out.append("rows", row)  # the file is rewritten after each row
                eager, graph = ms["eager"], ms["graph"]
                print(f"{op:7} {bank_name:11} {'x'.join(map(str, bank)):>12} {dtype_name:5} | "
                      f"{eager['torch']:14.3f} {eager['triton']:7.3f} {row['eager_speedup']:6.2f}x | "
                      f"{graph['torch']:14.3f} {graph['triton']:7.3f} {row['graph_speedup']:6.2f}x | "
                      f"{row['tflops']['torch']:10.1f} {row['tflops']['triton']:6.1f} | "
                      f"{(f'{target:.1f}x' if target else '-'):>6} {row['max_rel_err']:7.1e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
