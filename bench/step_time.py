"""Optimizer step time against the forward+backward of a training batch, on one GPU.

    python bench/step_time.py                       # GPT-2 small, 64 x 1024 tokens, bf16 autocast
    python bench/step_time.py --assign unconstrained

Builds train_gpt2.GPT (GPT-2 small by default), runs forward+backward of a --batch x --seq-len
token batch (random tokens; split into --micro-batch pieces to bound memory), then times the
ManifoldMuon step on the real gradients for each --assign given, as the trainer runs it (warm
started after the first step), for each kernel backend and ADMM clip, and prints optimizer ms /
forward+backward ms. Medians of --repeat timed runs after a warm-up.
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train_gpt2  # noqa: E402
from bench.results import Results  # noqa: E402


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
    ap.add_argument("--out", default=None, help="JSON results, rewritten after every measurement")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)
    results = Results(args.out, device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                      torch=torch.__version__, config=vars(args))
    for assign in args.assign:
        targs = train_gpt2.parse_args(["--assign", assign, "--n-layer", str(args.n_layer), "--n-embd",
                                       str(args.n_embd), "--n-head", str(args.n_head), "--seq-len", str(args.seq_len)])
        train_gpt2.validate_args(targs)
        torch.manual_seed(0)
        model = train_gpt2.GPT(train_gpt2.GPTConfig(args.n_layer, args.n_head, args.n_embd, args.seq_len,
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
        for backend in args.kernels:
            for clip in args.clips:
                name = backend if clip == "auto" else f"{backend}+{clip}"
                for group in muon.param_groups:
                    group["backend"], group["clip"] = backend, clip
                try:
                    opt = timed(muon.step, device, args.repeat)
                except Exception as err:  # report and go on with the other settings
                    results.put(assign, name, value={"error": f"{type(err).__name__}: {err}"})
                    print(f"{assign:14s} kernels {name}: FAILED {type(err).__name__}: {err}", flush=True)
                    continue
                results.put(assign, name, value={"muon_step_ms": 1000 * opt, "ratio": opt / fb,
                                                 "solver": muon.stats()})
                print(f"{assign:14s} kernels {name:12s} Muon step {1000 * opt:8.1f} ms | "
                      f"optimizer / fwd+bwd = {100 * opt / fb:5.1f}%", flush=True)
        del model, muon, adamw, step_model
        torch.cuda.empty_cache() if device.type == "cuda" else None


if __name__ == "__main__":
    main()
