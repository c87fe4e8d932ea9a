"""Whole-step throughput of the trainer: manifold Muon against plain Muon and AdamW alone.

    python -m bench.throughput                      # tiny GPT-2 on CPU (2 layers, width 256)
    python -m bench.throughput --n-layer 12 --n-embd 768 --batch 16 --seq-len 1024   # on a GPU

For each setting (--settings: an --assign value, or `adamw` for --optimizer adamw) it builds
train_gpt2's model and optimizers and times the training step as the loop runs it: forward and
backward on a random-token batch, gradient clipping, the AdamW and Muon steps. The settings
are interleaved round by round in one process, so load on a shared machine hits them alike;
it prints median tokens/s and each setting's ratio to the first.
"""
import argparse
import statistics
import time

import torch

import train_gpt2
from bench.results import Results
from model import GPT, GPTConfig


def build(setting, args, device):
    flags = ["--optimizer", "adamw", "--assign", "unconstrained"] if setting == "adamw" else ["--assign", setting]
    targs = train_gpt2.parse_args(flags + ["--n-layer", str(args.n_layer), "--n-embd", str(args.n_embd),
                                           "--n-head", str(args.n_head), "--seq-len", str(args.seq_len)])
    train_gpt2.validate_args(targs)
    torch.manual_seed(0)
    model = GPT(GPTConfig(args.n_layer, args.n_head, args.n_embd, args.seq_len,
                          50304)).to(device)
    muon, adamw = train_gpt2.build_optimizers(model, targs, device)
    return model, muon, adamw


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--settings", nargs="+", default=["adamw", "unconstrained", "hetero"])
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--n-embd", type=int, default=256)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds (one step per setting each)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=None, help="JSON results, rewritten after every timed round")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    runs = {s: build(s, args, device) for s in args.settings}
    tokens = torch.randint(0, 50257, (args.batch, args.seq_len + 1), device=device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def step(model, muon, adamw):
        with autocast:
            loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        adamw.step()
        muon.step()
        adamw.zero_grad(set_to_none=True)
        muon.zero_grad(set_to_none=True)

    per_step = args.batch * args.seq_len
    results = Results(args.out, config=vars(args), rounds=0, tokens_per_s={}, ratio_to_first={})
    times = {s: [] for s in args.settings}
    for r in range(args.rounds + 1):  # round 0 is the warm-up (states created, warm starts)
        for s in args.settings:
            sync()
            t0 = time.perf_counter()
            step(*runs[s])
            sync()
            if r:
                times[s].append(time.perf_counter() - t0)
        if r:  # the medians so far, after every round: a bench cut short keeps its figures
            base = per_step / statistics.median(times[args.settings[0]])
            for s in args.settings:
                tps = per_step / statistics.median(times[s])
                results.data["tokens_per_s"][s], results.data["ratio_to_first"][s] = tps, tps / base
            results.put("rounds", value=r)
    print(f"GPT-2 {args.n_layer}L {args.n_embd}D, {args.batch} x {args.seq_len} tokens per step, {device}:")
    for s in args.settings:
        tps, ratio = results.data["tokens_per_s"][s], results.data["ratio_to_first"][s]
        print(f"  {s:14s} {tps:10.0f} tokens/s   {ratio:5.2f}x of {args.settings[0]}")


if __name__ == "__main__":
    main()
