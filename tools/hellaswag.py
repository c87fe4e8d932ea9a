"""HellaSwag accuracy of a checkpoint: which of 4 endings the model finds most likely.

    python -m tools.hellaswag --out-dir runs/hetero --json runs/hetero/hellaswag.json
    python -m tools.hellaswag --checkpoint ckpt.pt --jsonl hellaswag_val.jsonl --limit 1000

Data: the hub dataset `Rowan/hellaswag` (validation: 10,042 items) through `datasets`, or with
--jsonl a local file in HellaSwag's format, one item per line: `ctx` (or `ctx_a` and `ctx_b`),
`endings` (4 strings) and `label` (0-3, a number or a string), as in the original
hellaswag_val.jsonl and the hub's rows (other fields are ignored).

Scoring, llm.c's "completion style" (dev/data/hellaswag.py in karpathy/llm.c): the tokens of ctx followed by
those of " " + ending; per ending, the log-probability of each ending token given everything
before it, from the model's softmax over the 50257 BPE tokens (padded rows at -inf):
    score(ending)  = sum_j log p(e_j | ctx, e_<j)
    acc            = mean over items of [argmax_i score(ending_i)    == label]
    acc_norm       = mean over items of [argmax_i score(ending_i)/n_i == label],  n_i = tokens of ending i
acc_norm normalises by tokens (llm.c), not by bytes as lm-evaluation-harness does, which also
rewrites the text (activity label prefix, [title] markers); the two figures differ (llm.c's notes
on GPT-2 124M: 0.2955 acc_norm here, 0.3114 from the harness). For the harness's figure, export
the checkpoint (export_hf.py) and run lm_eval on the folder. A row longer than the model's
context loses its first tokens (as lm-eval truncates: the last seq_len + 1 tokens); an empty
context is the end-of-text token. Ties go to the first ending.

Progress goes to stderr every --log-every items; the JSON (with each item's scores) to --json,
rewritten as it goes, and its summary as the last line of stdout.
"""
import argparse
import json
import os
import sys
import time

import torch

from bench.results import Results
from data.bpe import gpt2_encoding
from errors import UserError, run_cli
from training.model_io import (EOT, HelpFormatter, add_checkpoint_flags, find_checkpoint,
                               gpt2_logits, load_model, pick_device, require_gpt2_vocab)

HUB_DATASET = "Rowan/hellaswag"
ENDINGS = 4

# ----------------------------------------------------------------------------------------
# Items


def parse_item(row, where):
    """{"ctx", "endings", "label"} of a HellaSwag row (original jsonl or hub format)."""
    if not isinstance(row, dict):
        raise UserError(f"{where}: not a JSON object")
    context = row.get("ctx")
    if context is None and "ctx_a" in row:
        context = (row["ctx_a"] + " " + row.get("ctx_b", "")).strip()
    endings, label = row.get("endings"), row.get("label")
    if not isinstance(context, str):
        raise UserError(f"{where}: no `ctx` text (nor `ctx_a`)")
    if not (isinstance(endings, list) and len(endings) == ENDINGS and all(isinstance(e, str) for e in endings)):
        raise UserError(f"{where}: `endings` must be a list of {ENDINGS} strings")
    try:
        label = int(label)
    except (TypeError, ValueError):
        raise UserError(f"{where}: `label` {label!r} is not an ending number (the hub's test split has none; "
                        "use validation)") from None
    if not 0 <= label < ENDINGS:
        raise UserError(f"{where}: `label` {label} is not in 0..{ENDINGS - 1}")
    return {"ctx": context, "endings": endings, "label": label}


def read_jsonl(path):
    if not os.path.isfile(path):
        raise UserError(f"--jsonl {path}: no such file")
    items = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise UserError(f"{path} line {number}: not JSON ({err.msg})") from None
            items.append(parse_item(row, f"{path} line {number}"))
    if not items:
        raise UserError(f"--jsonl {path}: no items")
    return items


def read_hub(split, revision):
    import datasets  # slow to import: only for the hub
    try:
        rows = datasets.load_dataset(HUB_DATASET, split=split, revision=revision)
    except Exception as err:  # offline, no such revision or split, a loading script: all "use --jsonl"
        offline = " (HF_DATASETS_OFFLINE / HF_HUB_OFFLINE is set)" if datasets.config.HF_HUB_OFFLINE else ""
        raise UserError(f"cannot load {HUB_DATASET} split {split}{offline}: {type(err).__name__}: "
                        f"{str(err)[:200]}; pass --jsonl PATH to a local HellaSwag file") from None
    return [parse_item(row, f"{HUB_DATASET} {split} row {i}") for i, row in enumerate(rows)]


# ----------------------------------------------------------------------------------------
# Scoring


def render(item, encode):
    """(context tokens, [ending tokens] x 4): ctx, then " " + ending (the ending starts a new word)."""
    context = encode(item["ctx"]) or [EOT]  # an empty context: condition on the document start
    return context, [encode(" " + ending) for ending in item["endings"]]


@torch.no_grad()
def ending_logprobs(model, context, endings):
    """Per ending, a 1-D tensor: log p(e_j | context, e_<j) for each of its tokens. The 4 rows go
    through the model as one right-padded batch (causal: padding after a row cannot change it)."""
    seq_len = model.cfg.seq_len
    rows, firsts = [], []
    for ending in endings:
        if not 0 < len(ending) <= seq_len:
            raise UserError(f"an ending of {len(ending)} tokens does not fit the model's context of {seq_len}")
        tokens = (context + ending)[-(seq_len + 1):]  # inputs: all but the last; targets: all but the first
        rows.append(tokens)
        firsts.append(len(tokens) - len(ending))  # index of the ending's first token in `tokens`
    width = max(len(r) for r in rows) - 1
    device = model.wte.weight.device
    idx = torch.full((len(rows), width), EOT, dtype=torch.long, device=device)
    targets = torch.zeros_like(idx)
    for i, tokens in enumerate(rows):
        idx[i, :len(tokens) - 1] = torch.tensor(tokens[:-1])
        targets[i, :len(tokens) - 1] = torch.tensor(tokens[1:])
    logprobs = torch.log_softmax(gpt2_logits(model, idx), dim=-1).gather(-1, targets[..., None])[..., 0]
    # position p predicts token p + 1: the ending's tokens first..len-1 are read at first-1..len-2
    return [logprobs[i, first - 1:len(tokens) - 1].cpu() for i, (tokens, first) in enumerate(zip(rows, firsts))]


def choose(logprobs):
    """(pred, pred_norm, sums, means) of one item's per-token log-probs; ties go to the first ending."""
    sums = [float(lp.double().sum()) for lp in logprobs]
    means = [s / len(lp) for s, lp in zip(sums, logprobs)]
    return max(range(len(sums)), key=sums.__getitem__), max(range(len(means)), key=means.__getitem__), sums, means


def evaluate(items, score, encode, results=None, log_every=0, say=lambda *a: None):
    """Score `items` with score(context, endings) -> per-token log-probs; returns the summary dict.
    Each item's record goes to results["per_item"] (if given), saved every log_every items."""
    correct = correct_norm = 0
    start = time.perf_counter()
    per_item = []
    for n, item in enumerate(items, 1):
        context, endings = render(item, encode)
        pred, pred_norm, sums, means = choose(score(context, endings))
        correct += pred == item["label"]
        correct_norm += pred_norm == item["label"]
        per_item.append({"label": item["label"], "pred": pred, "pred_norm": pred_norm, "sum_logprob": sums,
                         "mean_logprob": means, "ending_tokens": [len(e) for e in endings]})
        if log_every and (n % log_every == 0 or n == len(items)):
            rate = n / (time.perf_counter() - start)
            say(f"hellaswag {n}/{len(items)}: acc {correct / n:.4f} acc_norm {correct_norm / n:.4f} "
                f"({rate:.1f} items/s)")
            if results is not None:
                results.put("per_item", value=per_item)
    n = len(items)
    summary = {"items": n, "acc": correct / n, "acc_norm": correct_norm / n, "correct": correct,
               "correct_norm": correct_norm, "seconds": round(time.perf_counter() - start, 3)}
    if results is not None:  # the summary before the long per-item list
        results.data = {**{k: v for k, v in results.data.items() if k != "per_item"}, **summary,
                        "per_item": per_item}
        results.save()
    return summary, per_item


# ----------------------------------------------------------------------------------------
# Command line


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    add_checkpoint_flags(p)
    p.add_argument("--jsonl", metavar="PATH", default=None,
                   help=f"a local HellaSwag jsonl instead of the hub's {HUB_DATASET}")
    p.add_argument("--split", default="validation", help=f"split of {HUB_DATASET} (the test split has no labels)")
    p.add_argument("--revision", default=None, help=f"revision of {HUB_DATASET} (a branch, tag or commit)")
    p.add_argument("--limit", type=int, default=0, help="score only the first N items (0 = all)")
    p.add_argument("--json", metavar="PATH", default=None,
                   help="write the summary and every item's scores there (rewritten every --log-every items)")
    p.add_argument("--log-every", type=int, default=500, help="a progress line every N items")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.limit < 0 or args.log_every <= 0:
        raise UserError("--limit must be >= 0 and --log-every positive")
    say = lambda *a: print(*a, file=sys.stderr, flush=True)  # noqa: E731
    device = pick_device(args.device)
    path, payload = find_checkpoint(args.checkpoint, args.out_dir, say)
    model = load_model(payload, device)
    require_gpt2_vocab(model.cfg, "HellaSwag")
    encoding, _ = gpt2_encoding(args.bpe_file)
    items = read_jsonl(args.jsonl) if args.jsonl else read_hub(args.split, args.revision)
    source = args.jsonl or f"{HUB_DATASET} {args.split}"
    items = items[:args.limit] if args.limit else items
    say(f"{path} (step {payload.get('step')}) on {device.type}: {len(items)} items of {source}")
    results = Results(args.json, benchmark="hellaswag", checkpoint=path, step=payload.get("step"),
                      source=source, normalisation="acc_norm: mean log-prob per ending token (llm.c)",
                      device=device.type)

    def score(context, endings):
        return ending_logprobs(model, context, endings)

    summary, _ = evaluate(items, score, encoding.encode_ordinary, results, args.log_every, say)
    print(json.dumps({"checkpoint": path, "step": payload.get("step"), "source": source, **summary}))
    return summary


if __name__ == "__main__":
    run_cli(main)
