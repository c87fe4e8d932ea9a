"""Tiny GPT-2-vocabulary checkpoints for the tests of sample.py, export_hf.py and tools/hellaswag.py.

A checkpoint payload as the trainer writes it, for what those tools read: "format", "step",
"model" (the state dict) and "args" (the trainer's own parsed flags). The weights are drawn so
that every part of the model shows in the logits (GPT-2's init at this width leaves the blocks
almost silent): LayerNorm gains away from 1, larger QKV and MLP input matrices, a larger embedding.
"""
import os

import torch

import train_gpt2
from model import GPT, GPTConfig
from training.checkpoints import checkpoint_path, save_atomic


def tiny_model(n_layer=2, n_head=2, n_embd=32, seq_len=32, vocab_size=50304, seed=0):
    torch.manual_seed(seed)
    model = GPT(GPTConfig(n_layer, n_head, n_embd, seq_len, vocab_size))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "ln_" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif "wte" in name:
                p.mul_(25)  # std 0.5: logits far from uniform, so samples and scores depend on the weights
            elif "c_attn" in name or "c_fc" in name:
                p.mul_(20)  # pre-activations of order 1: attention far from uniform, GELU far from linear
    return model.eval()


def trainer_logits(model, idx, vocab=None):
    """(B, T, vocab) float32 logits as GPT.forward (the trainer's path, not the tools' shared
    training.model_io one) computes them, read at the head; rows past `vocab` dropped."""
    seen = []
    hook = model.lm_head.register_forward_hook(lambda module, inputs, out: seen.append(out))
    try:
        with torch.no_grad():
            model(idx, idx)
    finally:
        hook.remove()
    return seen[0][..., :vocab].float()


def write_checkpoint(out_dir, model, step=7, assign="hetero"):
    """ckpt_<step>.pt in out_dir (with its SHA-256 manifest); returns its path."""
    cfg = model.cfg
    args = train_gpt2.parse_args(["--n-layer", str(cfg.n_layer), "--n-head", str(cfg.n_head),
                                  "--n-embd", str(cfg.n_embd), "--seq-len", str(cfg.seq_len),
                                  "--vocab-size", str(cfg.vocab_size), "--assign", assign])
    payload = {"format": "manifold-muon-ckpt-1", "step": step, "model": model.state_dict(), "args": vars(args)}
    os.makedirs(out_dir, exist_ok=True)
    path = checkpoint_path(str(out_dir), step)
    save_atomic(payload, path)
    return path


def train_checkpoints(data_dir, out_dir, steps=2):
    """Run the trainer for `steps` steps on the tiny shards with a 50304-row vocabulary and an
    assignment that splits the fused QKV for the optimizer; a checkpoint after every step."""
    from synthetic import TINY_MODEL
    train_gpt2.main(["--data-dir", data_dir, "--out-dir", str(out_dir), *TINY_MODEL, "--vocab-size", "50304",
                     "--assign", "attn.q=stiefel,attn.k=stiefel,attn.v=none,mlp=dgram", "--max-steps", str(steps),
                     "--warmup-steps", "1", "--eval-every", str(steps), "--eval-tokens", "256", "--ckpt-every", "1",
                     "--keep-ckpts", str(steps)])
    return str(out_dir)
