"""tools/hellaswag.py: acc and acc_norm on a 5-item fixture, by hand and against a per-token reference."""
import json
import os

import pytest
import torch

from tools import hellaswag
from data.bpe import gpt2_encoding
from errors import UserError, run_cli
from tiny_gpt import tiny_model, write_checkpoint
from training.model_io import GPT2_VOCAB, gpt2_logits

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "hellaswag_mini.jsonl")

# Per item: the log-probability every token of each ending gets from the stub scorer, with the
# ending's length in words (the stub's tokens). Worked out by hand:
#   item  label  words      log-prob/token            sums                       pred  means -> pred_norm
#   0     0      2 4 3 5    -1.0 -0.6 -2.0 -0.9       -2.0 -2.4 -6.0 -4.5        0 ok  1 (-0.6)  wrong
#   1     3      3 3 2 6    -1.5 -2.0 -2.5 -0.8       -4.5 -6.0 -5.0 -4.8        0     3 (-0.8)  ok
#   2     1      4 2 4 4    -1.2 -1.0 -3.0 -2.0       -4.8 -2.0 -12. -8.0        1 ok  1 (-1.0)  ok
#   3     2      2 5 6 2    -0.5 -0.9 -0.7 -3.0       -1.0 -4.5 -4.2 -6.0        0     0 (-0.5)  wrong
#   4     2      3 4 2 6    -1.5 -1.2 -1.0 -0.5       -4.5 -4.8 -2.0 -3.0        2 ok  3 (-0.5)  wrong
# acc = 3/5 (items 0, 2, 4); acc_norm = 2/5 (items 1, 2).
WORDS = [[2, 4, 3, 5], [3, 3, 2, 6], [4, 2, 4, 4], [2, 5, 6, 2], [3, 4, 2, 6]]
LOGPROB = [[-1.0, -0.6, -2.0, -0.9], [-1.5, -2.0, -2.5, -0.8], [-1.2, -1.0, -3.0, -2.0],
           [-0.5, -0.9, -0.7, -3.0], [-1.5, -1.2, -1.0, -0.5]]
PRED, PRED_NORM = [0, 0, 1, 0, 2], [1, 3, 1, 0, 3]


@pytest.fixture(scope="module")
def items():
    return hellaswag.read_jsonl(FIXTURE)


def test_the_fixture_reads_in_both_label_formats(items):
    assert [item["label"] for item in items] == [0, 3, 1, 2, 2]  # the last one is the string "2" (hub style)
    assert items[0]["ctx"] == "A man fills a kettle with water and sets it on the stove. he"
    assert [[len(e.split()) for e in item["endings"]] for item in items] == WORDS


def test_acc_and_acc_norm_on_the_fixture_are_the_hand_computed_ones(items):
    by_text = {" " + ending: LOGPROB[i][j] for i, item in enumerate(items) for j, ending in enumerate(item["endings"])}

    def encode(text):  # one token per word; an ending's tokens carry their text for the stub
        return [text] * len(text.split()) if text in by_text else text.split()

    def stub(context, endings):
        return [torch.full((len(ending),), by_text[ending[0]]) for ending in endings]

    summary, per_item = hellaswag.evaluate(items, stub, encode)
    assert [r["pred"] for r in per_item] == PRED and [r["pred_norm"] for r in per_item] == PRED_NORM
    assert summary["acc"] == pytest.approx(3 / 5) and summary["acc_norm"] == pytest.approx(2 / 5)
    assert (summary["correct"], summary["correct_norm"], summary["items"]) == (3, 2, 5)
    assert per_item[0]["sum_logprob"] == pytest.approx([-2.0, -2.4, -6.0, -4.5])


def reference_logprobs(model, context, ending):
    """One forward per ending token, on exactly the tokens before it: no batch, no padding."""
    tokens = context + ending
    out = []
    for k in range(len(context), len(tokens)):
        scores = gpt2_logits(model, torch.tensor([tokens[:k]]))[0, -1, :GPT2_VOCAB]
        out.append(torch.log_softmax(scores, dim=-1)[tokens[k]].item())
    return out


def test_model_scores_equal_a_per_token_reference(items):
    model = tiny_model(seq_len=64)
    encode = gpt2_encoding()[0].encode_ordinary
    summary, per_item = hellaswag.evaluate(items, lambda c, e: hellaswag.ending_logprobs(model, c, e), encode)
    correct = correct_norm = 0
    for item, record in zip(items, per_item):
        context, endings = hellaswag.render(item, encode)
        assert len(context) + max(map(len, endings)) <= 64  # no cropping in this test
        with torch.no_grad():
            reference = [reference_logprobs(model, context, ending) for ending in endings]
        sums = [sum(r) for r in reference]
        means = [s / len(r) for s, r in zip(sums, reference)]
        assert record["sum_logprob"] == pytest.approx(sums, rel=1e-5, abs=1e-4)
        assert record["mean_logprob"] == pytest.approx(means, rel=1e-5, abs=1e-4)
        assert record["pred"] == sums.index(max(sums)) and record["pred_norm"] == means.index(max(means))
        correct += record["pred"] == item["label"]
        correct_norm += record["pred_norm"] == item["label"]
    assert summary["acc"] == correct / 5 and summary["acc_norm"] == correct_norm / 5


def test_a_row_longer_than_the_context_keeps_its_last_tokens():
    """lm-eval's truncation: the row's last seq_len + 1 tokens, so the ending is scored whole."""
    model = tiny_model(seq_len=16)
    context, ending = list(range(1000, 1030)), [11, 12, 13]
    long = hellaswag.ending_logprobs(model, context, [ending] * 4)
    kept = hellaswag.ending_logprobs(model, context[-(17 - 3):], [ending] * 4)
    assert len(long[0]) == 3
    torch.testing.assert_close(long[0], kept[0])
    with pytest.raises(UserError, match="does not fit"):
        hellaswag.ending_logprobs(model, context, [list(range(17))] * 4)


def test_cli_writes_json_with_limit_and_progress(items, tmp_path, capsys):
    checkpoint = write_checkpoint(tmp_path / "run", tiny_model(seq_len=64))
    out = tmp_path / "hellaswag.json"
    summary = hellaswag.main(["--checkpoint", checkpoint, "--jsonl", FIXTURE, "--limit", "3", "--json", str(out),
                              "--log-every", "2", "--device", "cpu"])
    captured = capsys.readouterr()
    assert "hellaswag 2/3" in captured.err and "hellaswag 3/3" in captured.err
    assert json.loads(captured.out.strip().splitlines()[-1])["items"] == 3
    written = json.loads(out.read_text())
    assert written["items"] == 3 and len(written["per_item"]) == 3 and written["step"] == 7
    labels = [item["label"] for item in items[:3]]
    assert written["acc"] == sum(r["pred"] == y for r, y in zip(written["per_item"], labels)) / 3
    assert written["acc_norm"] == summary["acc_norm"]


def test_bad_data_is_one_error_line(tmp_path, capsys):
    checkpoint = write_checkpoint(tmp_path / "run", tiny_model(seq_len=64))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"ctx": "x", "endings": ["a", "b", "c"], "label": 0}) + "\n")
    offline = os.environ.get("HF_HUB_OFFLINE") == "1" and os.environ.get("HF_DATASETS_OFFLINE") == "1"
    cases = [(["--jsonl", str(bad)], "line 1: `endings` must be a list of 4")]
    if offline:  # the hub cannot be reached: the message points to --jsonl
        cases.append(([], "pass --jsonl PATH"))
    for extra, message in cases:
        with pytest.raises(SystemExit) as stop:
            run_cli(hellaswag.main, ["--checkpoint", checkpoint, "--device", "cpu", *extra])
        err = capsys.readouterr().err.strip().splitlines()
        assert stop.value.code == 2 and err[-1].startswith("error: ") and message in err[-1], err
