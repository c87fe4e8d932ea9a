"""Export a checkpoint as a Hugging Face `transformers` GPT-2 folder.

    python export_hf.py --out-dir runs/hetero --hf-dir exports/hetero
    python export_hf.py --checkpoint runs/hetero/ckpt_00050000.pt --hf-dir exports/hetero --overwrite

The folder (config.json, model.safetensors, generation_config.json, vocab.json, merges.txt,
tokenizer.json, tokenizer_config.json) loads offline with GPT2LMHeadModel.from_pretrained(DIR)
and AutoTokenizer.from_pretrained(DIR), and so with anything built on them, such as
lm-evaluation-harness (`lm_eval --model hf --model_args pretrained=DIR --tasks hellaswag`).

What maps to what (our GPT -> GPT2LMHeadModel):
  - nn.Linear keeps W as (out, in) and computes x W^T; HF's Conv1D keeps (in, out) and computes
    x W + b: every block matrix is transposed. Our model has no biases and LayerNorms without a
    bias: HF's biases are written as zeros, which computes the same function.
  - exact GELU (F.gelu): activation_function "gelu" (HF's default "gelu_new" is the tanh one).
  - the head is tied to the token embedding, as in HF's GPT-2 (tie_word_embeddings).
  - vocabulary: the first 50257 embedding rows, the tokens of the BPE. Our --vocab-size pads to
    50304 for matmul speed; rows 50257.. are no token, the tokenizer cannot decode them, and
    sample.py and tools/hellaswag.py treat their logits as -inf: cutting them gives the same
    softmax over real tokens, and HF's generate cannot pick an id the tokenizer lacks.
  - n_positions = --seq-len (learned positions: no longer context exists), eps 1e-5, no dropout.
The tokenizer files are built from the tiktoken GPT-2 ranks, offline (data/bpe.py); after
writing, the folder is loaded back and its logits and tokens are checked against ours.
"""
import argparse
import json
import os
import shutil
import sys

import torch

from data.bpe import EOT as EOT_TEXT, gpt2_encoding
from errors import UserError, run_cli, write_error
from training.model_io import (GPT2_VOCAB, HelpFormatter, add_checkpoint_flags, find_checkpoint, gpt2_logits,
                               load_model, model_state, require_gpt2_vocab)

LINEARS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
# max |logit difference| / max |logit| accepted after the export. Both sides are fp32 on the CPU and
# compute the same products (HF's Conv1D as addmm with a zero bias): measured 0 here, rounding
# elsewhere (~1e-7); the tanh GELU in place of the exact one already shows as ~6e-5 on a tiny model.
VERIFY_TOLERANCE = 1e-5
VERIFY_TEXT = "Hello world! Ünïcödé, tabs\tand   runs of spaces\n\nand 12345 numbers."

# ----------------------------------------------------------------------------------------
# Tokenizer files from the tiktoken ranks


def bytes_to_unicode():
    """GPT-2's byte -> printable character table: bytes that print as themselves keep their
    character, the other 68 (control, space, ...) go to chr(256 + n) in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for byte in range(256):
        if byte in keep:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


def bpe_parts(ranks, token, max_rank):
    """tiktoken's BPE on the bytes of `token` with only the merges ranked below max_rank: repeatedly
    merge the adjacent pair whose concatenation has the lowest rank."""
    parts = [bytes([b]) for b in token]
    while len(parts) > 1:
        best, best_rank = None, max_rank
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and rank < best_rank:
                best, best_rank = i, rank
        if best is None:
            break
        parts[best:best + 2] = [parts[best] + parts[best + 1]]
    return parts


def recover_merges(ranks):
    """[(left, right)] in rank order: the merge that made each multi-byte token.

    A token of rank r was made by one merge, learned after every token of lower rank. BPE on the
    token's bytes with only those lower-ranked merges stops at the two parts that merge into it.
    HF's BPE applies a merges list by priority (lowest line first), as tiktoken applies ranks,
    so listing the merges in rank order encodes the same."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) == 1:
            continue
        parts = bpe_parts(ranks, token, rank)
        if len(parts) != 2:
            raise UserError(f"the BPE ranks are not GPT-2's: token {token!r} (rank {rank}) is no merge of two "
                            f"lower-ranked tokens")
        merges.append((parts[0], parts[1]))
    return merges


def tokenizer_tables(encoding):
    """(vocab {byte-level string: id}, merges ["left right", ...]) of a tiktoken GPT-2 encoding."""
    ranks = encoding._mergeable_ranks  # token bytes -> rank (= id); tiktoken keeps no public accessor
    if len(ranks) != GPT2_VOCAB - 1 or encoding.eot_token != GPT2_VOCAB - 1:
        raise UserError(f"the BPE has {len(ranks)} ranks and end-of-text {encoding.eot_token}: not GPT-2's")
    to_unicode = bytes_to_unicode()

    def text(token):
        return "".join(to_unicode[b] for b in token)

    vocab = {text(token): rank for token, rank in ranks.items()}
    vocab[EOT_TEXT] = encoding.eot_token
    merges = [f"{text(left)} {text(right)}" for left, right in recover_merges(ranks)]
    return vocab, merges


def write_tokenizer(folder, encoding, seq_len):
    """vocab.json, merges.txt (the classic GPT-2 pair, read by any GPT-2 tokenizer) and
    tokenizer.json + tokenizer_config.json (what transformers' tokenizers backend saves)."""
    from transformers import GPT2Tokenizer
    vocab, merges = tokenizer_tables(encoding)
    with open(os.path.join(folder, "vocab.json"), "w", encoding="utf-8") as f:
        json.dump(vocab, f, ensure_ascii=False)
    with open(os.path.join(folder, "merges.txt"), "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n" + "\n".join(merges) + "\n")
    tokenizer = GPT2Tokenizer(vocab=vocab, merges=[tuple(m.split(" ")) for m in merges],
                              model_max_length=seq_len)
    tokenizer.save_pretrained(folder)


# ----------------------------------------------------------------------------------------
# Model weights


def hf_config(cfg):
    from transformers import GPT2Config
    return GPT2Config(vocab_size=GPT2_VOCAB, n_positions=cfg.seq_len, n_embd=cfg.n_embd, n_layer=cfg.n_layer,
                      n_head=cfg.n_head, n_inner=4 * cfg.n_embd, activation_function="gelu",
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=1e-5,
                      tie_word_embeddings=True, bos_token_id=GPT2_VOCAB - 1, eos_token_id=GPT2_VOCAB - 1,
                      architectures=["GPT2LMHeadModel"], dtype="float32")


def hf_state_dict(state, cfg):
    """Our state dict -> GPT2LMHeadModel's (see the module docstring for the mapping)."""
    wte = state["wte.weight"][:GPT2_VOCAB]

    def norm(weight):
        return {"weight": weight, "bias": torch.zeros_like(weight)}

    out = {"transformer.wte.weight": wte, "transformer.wpe.weight": state["wpe.weight"],
           "lm_head.weight": wte}
    out.update({f"transformer.ln_f.{k}": v for k, v in norm(state["ln_f.weight"]).items()})
    for i in range(cfg.n_layer):
        ours, theirs = f"blocks.{i}.", f"transformer.h.{i}."
        for ln in ("ln_1", "ln_2"):
            out.update({f"{theirs}{ln}.{k}": v for k, v in norm(state[f"{ours}{ln}.weight"]).items()})
        for linear in LINEARS:
            weight = state[f"{ours}{linear}.weight"]  # (out, in)
            out[f"{theirs}{linear}.weight"] = weight.t().contiguous()  # Conv1D: (in, out)
            out[f"{theirs}{linear}.bias"] = torch.zeros(weight.shape[0], dtype=weight.dtype)
    return out


def hf_model(payload):
    """The checkpoint as a GPT2LMHeadModel (float32, eval mode)."""
    from transformers import GPT2LMHeadModel
    model = load_model(payload)  # checks the weights against the checkpoint's own flags
    require_gpt2_vocab(model.cfg, "a GPT-2 export")
    if model.cfg.qk_norm or model.cfg.attn_softcap:
        raise UserError("this checkpoint was trained with --qk-norm or --attn-softcap, which GPT2LMHeadModel's "
                        "attention does not have: its export would compute other logits (--qk-clip runs export)")
    hf = GPT2LMHeadModel(hf_config(model.cfg))
    hf.load_state_dict(hf_state_dict(model_state(payload), model.cfg), strict=True)
    return hf.eval(), model


# ----------------------------------------------------------------------------------------
# Export and its check


def check_export(folder, model, encoding, tokens=64):
    """Load `folder` back; raise UserError unless its logits on random tokens and its tokenization of
    VERIFY_TEXT match ours. Returns the relative logit difference."""
    from transformers import AutoTokenizer, GPT2LMHeadModel
    hf = GPT2LMHeadModel.from_pretrained(folder).eval()
    generator = torch.Generator().manual_seed(0)
    idx = torch.randint(0, GPT2_VOCAB, (2, min(tokens, model.cfg.seq_len)), generator=generator)
    with torch.no_grad():
        ours = gpt2_logits(model, idx)[..., :GPT2_VOCAB]
        theirs = hf(idx).logits.float()
    relative = ((ours - theirs).abs().max() / ours.abs().max()).item()
    if not relative <= VERIFY_TOLERANCE:
        raise UserError(f"the export's logits differ from the checkpoint's by {relative:.2e} of the largest "
                        f"logit (tolerance {VERIFY_TOLERANCE:.0e}): the weight mapping is wrong")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if tokenizer(VERIFY_TEXT)["input_ids"] != encoding.encode_ordinary(VERIFY_TEXT):
        raise UserError("the exported tokenizer encodes differently from tiktoken's GPT-2 BPE")
    return relative


def prepare_folder(folder, overwrite):
    """Refuse to mix an export with other files; the export is written beside and renamed in."""
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise UserError(f"--hf-dir {folder} is a file")
    if os.path.isdir(folder) and os.listdir(folder):
        if not overwrite:
            raise UserError(f"--hf-dir {folder} is not empty (pass --overwrite to replace an earlier export)")
        if not os.path.exists(os.path.join(folder, "config.json")):
            raise UserError(f"--hf-dir {folder} holds files but no config.json: not an export, not replacing it")
    tmp = folder.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)  # a leftover of a killed export
    os.makedirs(tmp)
    return tmp


def write_folder(folder, hf, encoding, seq_len):
    hf.save_pretrained(folder)
    write_tokenizer(folder, encoding, seq_len)
    umask = os.umask(0)
    os.umask(umask)
    for name in os.listdir(folder):  # model.safetensors comes as 0600 (a renamed temporary file)
        os.chmod(os.path.join(folder, name), 0o666 & ~umask)


def export(payload, folder, encoding, overwrite=False, verify=True):
    """Write the HF folder of a checkpoint payload: into FOLDER.tmp, checked there, then renamed to
    FOLDER, so a failed or killed export leaves no half folder under the real name. Returns the
    checked relative logit difference (None without verify)."""
    hf, model = hf_model(payload)
    try:
        tmp = prepare_folder(folder, overwrite)
    except OSError as err:
        raise write_error(err.filename or folder, err) from None
    try:
        try:
            write_folder(tmp, hf, encoding, model.cfg.seq_len)
        except OSError as err:
            raise write_error(err.filename or tmp, err) from None
        difference = check_export(tmp, model, encoding) if verify else None
        try:
            if os.path.isdir(folder):
                shutil.rmtree(folder)
            os.replace(tmp, folder)
        except OSError as err:
            raise write_error(folder, err) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return difference


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    add_checkpoint_flags(p, device=False)  # the export runs on the CPU
    p.add_argument("--hf-dir", metavar="DIR", required=True, help="the Hugging Face folder to write")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier export in --hf-dir")
    p.add_argument("--no-verify", dest="verify", action="store_false",
                   help="skip loading the folder back to compare its logits and tokens with ours")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    from transformers.utils import logging
    logging.disable_progress_bar()  # per-shard bars of save and load; the one line below says what happened
    say = lambda *a: print(*a, file=sys.stderr)  # noqa: E731
    path, payload = find_checkpoint(args.checkpoint, args.out_dir, say)
    encoding, bpe_source = gpt2_encoding(args.bpe_file)
    difference = export(payload, args.hf_dir, encoding, args.overwrite, args.verify)
    check = (f"; checked: logits within {difference:.1e} of the largest, tokens equal to tiktoken's"
             if difference is not None else "")
    print(f"exported {path} (step {payload.get('step')}) to {args.hf_dir}; BPE from {bpe_source}{check}")


if __name__ == "__main__":
    run_cli(main)
