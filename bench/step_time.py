"""Optimizer step time against the forward+backward of a training batch, on one GPU.

    python -m bench.step_time                       # GPT-2 small, 64 x 1024 tokens, bf16 autocast
    python -m bench.step_time --assign unconstrained

Builds model.GPT (GPT-2 small by default), runs forward+backward of a --batch x --seq-len
token batch (random tokens; split into --micro-batch pieces to bound memory), then times the
ManifoldMuon step on the real gradients for each --assign given, as the trainer runs it (warm
started after the first step), for each kernel backend and ADMM clip (each an optimizer of its
own over the same parameters: the plan is fixed when one is built), and prints optimizer ms /
forward+backward ms. Medians of --repeat timed runs after a warm-up.

With --cuda-graph each setting is also captured as one CUDA graph (torch.cuda.CUDAGraph; the
sync-free step, lr in device tensors as a graph-replayed loop keeps it) and its replay timed:
the launch overhead the eager step pays on the host. The replay is checked against an eager
step from the same state (`graph_max_abs_diff`); on CPU the same replay semantics are checked
by tests/test_capturable.py with manifolds/step_graph.py.
"""
import argparse
import dataclasses
import time

import torch

import train_gpt2
from bench.results import Results
from manifolds import ManifoldMuon
from manifolds.step_graph import StepGraph, lr_in_device_tensors
from model import GPT, GPTConfig


def timed(fn, device, repeat):
    fn()  # warm-up: kernels compiled and autotuned, states created
    times = []
    for _ in range(repeat):
        torch.cuda.synchronize(device) if device.type == "cuda" else None
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize(device) if device.type == "cuda" else None
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def step_tensors(opt):
    """Every tensor a step reads and writes: the parameters and the optimizer state."""
    tensors = [p for group in opt.param_groups for p in group["params"]]
    return tensors + [v for state in opt.state.values() for v in state.values() if torch.is_tensor(v)]


def graphed_step(opt, device):
    """(replay, max |eager - replayed| of the parameters after one step from the same state):
    the step through manifolds.step_graph.StepGraph (two warm-up steps, then the capture), with
    the lr in device tensors first (a captured float would be a constant)."""
    lr_in_device_tensors(opt, device)
    graphed = StepGraph(opt.step, device)
    graphed()
    graphed()
    before = [t.clone() for t in step_tensors(opt)]
    opt.step()
    eager = [p.detach().clone() for group in opt.param_groups for p in group["params"]]
    with torch.no_grad():  # in place: the capture must see these tensors
        torch._foreach_copy_(step_tensors(opt), before)
    graphed()  # captured, then replayed once
    params = [p.detach() for group in opt.param_groups for p in group["params"]]
    return graphed, max(float((a - b).abs().max()) for a, b in zip(eager, params))


def with_solver(muon, **changes):
    """A fresh ManifoldMuon over `muon`'s parameter groups with these SolverOptions fields changed
    (backend, clip): its own plan, momenta and warm starts."""
    options = dataclasses.asdict(dataclasses.replace(muon.options, **changes))
    return ManifoldMuon([dict(group) for group in muon.param_groups], **options)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--assign", nargs="+", default=["hetero", "unconstrained"])
    ap.add_argument("--n-layer", type=int, default=12)
    ap.add_argument("--n-embd", type=int, default=768)
    ap.add_argument("--n-head", type=int, default=12)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--kernels", nargs="+", default=["auto", "torch"], help="optimizer kernel backends to time")
    ap.add_argument("--clips", nargs="+", default=["auto", "eigh"],
                    help="ADMM spectral clips to time (auto = polynomial on GPU; eigh = eigendecomposition)")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--cuda-graph", action="store_true",
                    help="also time each setting's step replayed from one CUDA graph (needs CUDA)")
    ap.add_argument("--out", default=None, help="JSON results, rewritten after every measurement")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.cuda_graph and device.type != "cuda":
        ap.error("--cuda-graph needs a CUDA device (on CPU, tests/test_capturable.py emulates the replay)")
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)
    results = Results(args.out, device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                      torch=torch.__version__, config=vars(args))
    for assign in args.assign:
        targs = train_gpt2.parse_args(["--assign", assign, "--n-layer", str(args.n_layer), "--n-embd",
                                       str(args.n_embd), "--n-head", str(args.n_head), "--seq-len", str(args.seq_len)])
        train_gpt2.validate_args(targs)
        torch.manual_seed(0)
        model = GPT(GPTConfig(args.n_layer, args.n_head, args.n_embd, args.seq_len,
                              50304)).to(device)
        muon, adamw = train_gpt2.build_optimizers(model, targs, device)
        step_model = torch.compile(model) if args.compile else model
        tokens = torch.randint(0, 50257, (args.batch, args.seq_len + 1), device=device)

        def forward_backward():
            for chunk in tokens.split(args.micro_batch):
                with autocast:
                    loss = step_model(chunk[:, :-1], chunk[:, 1:]) * (len(chunk) / args.batch)
                loss.backward()

        fb = timed(lambda: (model.zero_grad(set_to_none=True), forward_backward()), device, args.repeat)
        model.zero_grad(set_to_none=True)
        forward_backward()  # fresh gradients for the optimizer timing
        results.put(assign, "forward_backward_ms", value=1000 * fb)
        print(f"{assign:14s} forward+backward {1000 * fb:8.1f} ms", flush=True)
        setting = None
        for backend in args.kernels:
            for clip in args.clips:
                name = backend if clip == "auto" else f"{backend}+{clip}"
                try:
                    setting = with_solver(muon, backend=backend, clip=clip)
                    opt = timed(setting.step, device, args.repeat)
                except Exception as err:  # report and go on with the other settings
                    results.put(assign, name, value={"error": f"{type(err).__name__}: {err}"})
                    print(f"{assign:14s} kernels {name}: FAILED {type(err).__name__}: {err}", flush=True)
                    continue
                value = {"muon_step_ms": 1000 * opt, "ratio": opt / fb, "solver": setting.stats(),
                         "plan": setting.plan.as_dict()}
                line = (f"{assign:14s} kernels {name:12s} Muon step {1000 * opt:8.1f} ms | "
                        f"optimizer / fwd+bwd = {100 * opt / fb:5.1f}%")
                if args.cuda_graph:
                    try:
                        replay, diff = graphed_step(setting, device)
                        graph_ms = 1000 * timed(replay, device, args.repeat)
                        value.update(graph_ms=graph_ms, graph_ratio=graph_ms / (1000 * fb), graph_max_abs_diff=diff)
                        line += f" | CUDA graph {graph_ms:8.1f} ms = {100 * graph_ms / (1000 * fb):5.1f}% (diff {diff:.1e})"
                    except Exception as err:
                        value["graph_error"] = f"{type(err).__name__}: {err}"
                        line += f" | CUDA graph FAILED {type(err).__name__}: {err}"
                results.put(assign, name, value=value)
                print(line, flush=True)
        del model, muon, adamw, step_model, setting
        torch.cuda.empty_cache() if device.type == "cuda" else None


if __name__ == "__main__":
    main()
