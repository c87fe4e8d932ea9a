"""A trained GPT back from its checkpoint, and the next-token logits that GPT.forward does not return.

Checkpoints of every assignment and world size hold the same thing under "model": rank 0 writes
the plain module's state dict (not DDP's or torch.compile's wrapper), with the fused QKV matrix
whatever the assignment split for the optimizer. The shape comes from the training flags saved
under "args". sample.py, export_hf.py and tools/hellaswag.py read checkpoints through here.

Vocabulary: the embedding has --vocab-size rows (50304 = GPT-2's 50257 padded to a multiple of
64 for fast matmuls). Rows 50257.. are no token of the BPE: they are never a target in training
and the tokenizer cannot decode them, so every consumer here treats their logits as -inf
(`gpt2_logits`), which is the same as cutting the head to 50257 rows (what export_hf.py does).
"""
import argparse
import os
import warnings

import torch

from errors import UserError
from model import GPT, GPTConfig
from training.checkpoints import list_checkpoints, load_checkpoint, load_newest
from training.sharded_checkpoints import list_sharded_checkpoints, load_run_payload, verify_sharded

GPT2_VOCAB = 50257  # tokens of the GPT-2 BPE, end-of-text (50256) included
EOT = 50256
WRAPPER_PREFIXES = ("module.", "_orig_mod.")  # DDP and torch.compile, should a state dict carry them


def find_checkpoint(checkpoint=None, out_dir=None, say=print):
    """(path, payload) of --checkpoint PATH or of the newest checkpoint that loads in --out-dir: a
    ckpt_<step>.pt file, or an --fsdp run's ckpt_<step>.dcp folder (its model gathered whole here)."""
    if checkpoint is not None:
        if os.path.isdir(checkpoint):
            return checkpoint, sharded_payload(checkpoint)
        if not os.path.isfile(checkpoint):
            raise UserError(f"--checkpoint {checkpoint}: no such file or checkpoint folder")
        try:
            return checkpoint, load_checkpoint(checkpoint)
        except ValueError as err:
            raise UserError(str(err)) from None
    if not os.path.isdir(out_dir):
        raise UserError(f"--out-dir {out_dir}: no such folder")
    newest_file = next(iter(list_checkpoints(out_dir)), None)
    for folder in list_sharded_checkpoints(out_dir):  # an --fsdp run's, unless a newer file is there
        if newest_file is not None and os.path.basename(newest_file)[:-3] > os.path.basename(folder)[:-4]:
            break
        try:
            return folder, sharded_payload(folder)
        except UserError as err:
            say(f"skipping {err}")
    path, payload = load_newest(out_dir, say)
    if payload is None:
        raise UserError(f"--out-dir {out_dir}: no checkpoint that loads (ckpt_<step>.pt or ckpt_<step>.dcp)")
    return path, payload


def sharded_payload(folder):
    """An --fsdp checkpoint folder as a one-file checkpoint's payload: its run.pt, and under "model"
    the whole model's state, read from the shards by torch.distributed.checkpoint (no process group)."""
    import torch.distributed.checkpoint as dcp
    problem = verify_sharded(folder)
    if problem is not None:
        raise UserError(problem)
    try:
        payload = load_run_payload(folder)
    except (OSError, RuntimeError, ValueError) as err:
        raise UserError(f"{folder}: {err}") from None
    state = {"model": GPT(model_config(payload)).state_dict()}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=folder)
    return {**payload, "model": state["model"]}


def model_config(payload):
    """The GPTConfig a checkpoint was trained with (its saved training flags)."""
    saved = payload.get("args", {})
    missing = [k for k in ("n_layer", "n_head", "n_embd", "seq_len", "vocab_size") if k not in saved]
    if missing:
        raise UserError(f"the checkpoint's training flags lack {', '.join(missing)}: cannot rebuild its model")
    return GPTConfig(saved["n_layer"], saved["n_head"], saved["n_embd"], saved["seq_len"], saved["vocab_size"],
                     qk_norm=saved.get("qk_norm", False), attn_softcap=saved.get("attn_softcap", 0.0))


def model_state(payload):
    """The model's state dict with wrapper prefixes removed."""
    state = {}
    for name, tensor in payload["model"].items():
        for prefix in WRAPPER_PREFIXES:
            if name.startswith(prefix):
                name = name[len(prefix):]
        state[name] = tensor
    return state


def load_model(payload, device="cpu"):
    """The checkpoint's GPT in eval mode, float32, on `device`."""
    cfg = model_config(payload)
    model = GPT(cfg)
    try:
        model.load_state_dict(model_state(payload))
    except RuntimeError as err:  # missing/unexpected keys or shapes: not this trainer's model
        raise UserError(f"the checkpoint's weights do not fit a GPT of its own flags ({str(err)[:300]})") from None
    return model.to(device=device, dtype=torch.float32).eval()


def require_gpt2_vocab(cfg, what):
    if cfg.vocab_size < GPT2_VOCAB:
        raise UserError(f"{what} needs a model of the GPT-2 BPE vocabulary: this checkpoint has {cfg.vocab_size} "
                        f"embedding rows, fewer than the tokenizer's {GPT2_VOCAB} (trained on synthetic tokens?)")


def features(model, idx):
    """(B, T, n_embd) final-norm states: GPT.forward's computation up to the head, from the same
    modules (token embeddings + learned positions, the blocks, the final LayerNorm)."""
    T = idx.size(1)
    if T > model.cfg.seq_len:
        raise ValueError(f"{T} tokens exceed the model's context of {model.cfg.seq_len}")
    x = model.wte(idx) + model.wpe(torch.arange(T, device=idx.device))
    for block in model.blocks:
        x = block(x)
    return model.ln_f(x)


def mask_padded(scores):
    """Padded rows 50257..vocab_size-1 of `scores` to -inf (in place): a softmax over the BPE's tokens only."""
    scores[..., GPT2_VOCAB:] = float("-inf")
    return scores


def logits(model, idx):
    """(B, T, vocab_size) float32 logits of every position (the tied head applied to `features`)."""
    return model.lm_head(features(model, idx)).float()


def gpt2_logits(model, idx):
    """`logits` with the padded rows at -inf."""
    return mask_padded(logits(model, idx))


def pick_device(name):
    """--device auto|cpu|cuda -> torch.device; auto = cuda when available."""
    if name == "cuda" or (name == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise UserError("--device cuda was asked for but no CUDA device is available")
        return torch.device("cuda")
    return torch.device("cpu")


# ----------------------------------------------------------------------------------------
# The flags every tool on a checkpoint shares


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """--help keeps the module docstring's layout and shows the defaults that say something
    (not those of on/off switches, nor None or an empty string)."""

    def _get_help_string(self, action):
        if action.nargs == 0 or action.default is None or action.default == "":
            return action.help
        return super()._get_help_string(action)


def add_checkpoint_flags(parser, device=True):
    """--checkpoint PATH | --out-dir DIR (one of them), --device (if `device`), --bpe-file."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", metavar="PATH", help="a checkpoint file (ckpt_<step>.pt)")
    source.add_argument("--out-dir", metavar="DIR",
                        help="a run folder: its newest checkpoint that loads (corrupt ones are skipped)")
    if device:
        parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                            help="auto = cuda when available, else cpu (the model runs in float32)")
    parser.add_argument("--bpe-file", metavar="PATH", default=None,
                        help="a gpt2.tiktoken rank file (default: the bundled data/gpt2.tiktoken)")
