"""Continue a prompt with a trained checkpoint.

    python sample.py --out-dir runs/hetero --prompt "The meaning of life is" --num-samples 3
    python sample.py --checkpoint runs/hetero/ckpt_00050000.pt --max-new-tokens 200 --top-k 50

Reads a checkpoint of any assignment and world size (rank 0 writes the whole model), tokenizes
the prompt with GPT-2 BPE (offline: data/bpe.py) and samples each new token from the model's
softmax over the 50257 BPE tokens (the padded embedding rows are never chosen), divided by
--temperature and cut to the --top-k most likely. The context starts with the end-of-text
token, as every training document does (data/prepare.py puts it before each one); the model
sees at most its last --seq-len tokens (learned positions: no longer context exists). A sample
ends at --max-new-tokens or when the model ends the document (end-of-text). Each sample is
printed as prompt + continuation, followed by a line of dashes; what was loaded goes to stderr.
The same flags and --seed give the same text on the same machine.
"""
import argparse
import math
import sys

import torch

from data.bpe import gpt2_encoding
from errors import UserError, run_cli
from training.model_io import (EOT, HelpFormatter, add_checkpoint_flags, features, find_checkpoint, load_model,
                               mask_padded, pick_device, require_gpt2_vocab)

SEPARATOR = "-" * 40


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    add_checkpoint_flags(p)
    p.add_argument("--prompt", default="", help="text to continue (empty: the model starts a document)")
    p.add_argument("--num-samples", type=int, default=3, help="independent continuations of the prompt")
    p.add_argument("--max-new-tokens", type=int, default=100, help="most tokens generated per sample")
    p.add_argument("--temperature", type=float, default=1.0,
                   help="divides the logits before the softmax: < 1 sharper, > 1 flatter; 0 = greedy (argmax)")
    p.add_argument("--top-k", type=int, default=200,
                   help="sample among the k most likely tokens only (0 = all 50257)")
    p.add_argument("--seed", type=int, default=1337, help="seed of the sampling; same seed, same text")
    return p.parse_args(argv)


def validate_args(args):
    for name in ("num_samples", "max_new_tokens"):
        if getattr(args, name) <= 0:
            raise UserError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise UserError(f"--temperature must be a finite number >= 0 (0 = greedy), got {args.temperature}")
    if args.top_k < 0:
        raise UserError(f"--top-k must be >= 0 (0 = off), got {args.top_k}")


@torch.no_grad()
def generate(model, context, num_samples, max_new_tokens, temperature=1.0, top_k=0, generator=None):
    """(num_samples, len(context) + n) tokens: `context` followed by n <= max_new_tokens sampled
    ones; a row that has produced end-of-text is padded with it until every row has (or n is max)."""
    device = model.wte.weight.device
    idx = torch.tensor(context, dtype=torch.long, device=device).repeat(num_samples, 1)
    ended = torch.zeros(num_samples, dtype=torch.bool, device=device)
    for _ in range(max_new_tokens):
        window = idx[:, -model.cfg.seq_len:]  # crop: the model has seq_len learned positions
        scores = mask_padded(model.lm_head(features(model, window)[:, -1]).float())  # head on the last only
        if temperature == 0:
            token = scores.argmax(dim=-1, keepdim=True)
        else:
            scores = scores / temperature
            if top_k:
                kth = torch.topk(scores, min(top_k, scores.size(-1)), dim=-1).values[:, -1:]
                scores = scores.masked_fill(scores < kth, float("-inf"))
            token = torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=generator)
        token = token.masked_fill(ended[:, None], EOT)
        idx = torch.cat([idx, token], dim=1)
        ended |= token[:, 0] == EOT
        if ended.all():
            break
    return idx


def sample_text(encoding, prompt, new_tokens):
    """prompt + the text of `new_tokens` up to the first end-of-text. Decoded as one byte string, so a
    character split over tokens survives; bytes of a character the sample cut off become U+FFFD."""
    if EOT in new_tokens:
        new_tokens = new_tokens[:new_tokens.index(EOT)]
    return (encoding.decode_bytes(prompt) + encoding.decode_bytes(new_tokens)).decode("utf-8", errors="replace")


def sample(args, say=lambda *a: print(*a, file=sys.stderr)):
    """The samples' texts (each prompt + continuation)."""
    validate_args(args)
    device = pick_device(args.device)
    path, payload = find_checkpoint(args.checkpoint, args.out_dir, say)
    model = load_model(payload, device)
    cfg = model.cfg
    require_gpt2_vocab(cfg, "sampling text")
    encoding, bpe_source = gpt2_encoding(args.bpe_file)
    saved = payload.get("args", {})
    say(f"{path}: step {payload.get('step')}, assign {saved.get('assign')}, {cfg.n_layer}L {cfg.n_head}H "
        f"{cfg.n_embd}D, context {cfg.seq_len}, on {device.type}; BPE from {bpe_source}")
    # "<|endoftext|>" typed in a prompt is the document separator, not 13 characters of text
    prompt = encoding.encode(args.prompt, allowed_special="all")
    if len(prompt) + 1 > cfg.seq_len:
        say(f"the prompt has {len(prompt)} tokens: the model sees only the last {cfg.seq_len} of the context")
    generator = torch.Generator(device=device).manual_seed(args.seed)
    context = [EOT] + prompt
    rows = generate(model, context, args.num_samples, args.max_new_tokens, args.temperature, args.top_k, generator)
    return [sample_text(encoding, prompt, row[len(context):]) for row in rows.tolist()]


def main(argv=None):
    for text in sample(parse_args(argv)):
        print(text)
        print(SEPARATOR, flush=True)


if __name__ == "__main__":
    run_cli(main)
