"""export_hf.py: the Hugging Face GPT-2 folder computes our model's logits and tokenizes as tiktoken does."""
import json
import os
import shutil

import pytest
import torch

import export_hf
import sample
from data.bpe import gpt2_encoding
from errors import run_cli
from model import GPT, GPTConfig
from synthetic import make_shards
from tiny_gpt import tiny_model, train_checkpoints, trainer_logits, write_checkpoint
from training.model_io import EOT, GPT2_VOCAB, find_checkpoint, gpt2_logits

transformers = pytest.importorskip("transformers")
# fp32 on both sides, the same products (Conv1D's addmm with a zero bias, attention by HF's
# path): differences are rounding (0 measured here; ~1e-7 of the logit scale on other BLAS builds);
# 1e-5 still catches the tanh GELU for the exact one (~6e-5 on this model) and any wrong transpose or gain (O(1)).
RELATIVE_TOLERANCE = export_hf.VERIFY_TOLERANCE
PARAGRAPH = ("GPT-2's byte-level BPE: it doesn't drop anything.  Two spaces,\tone tab,\n\n\nthree newlines;"
             "    four spaces then text.\r\nWindows line end, trailing spaces   \n"
             "Ünïcödé: naïve café, Æsir, Привет мир, 日本語のテキスト, 한국어, emoji 🤖🚀 and 👩‍👩‍👧 "
             "(a ZWJ sequence), math ∑ x² ≤ ∞, numbers 1234567 3.14159 -42, contractions we'll they're I've, "
             "URLs https://a.b/c?d=e&f and symbols @#$%^&*()[]{}<>~`|\\ end.   ")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    model = tiny_model(n_layer=2, n_head=2, n_embd=32, seq_len=32)
    checkpoint = write_checkpoint(tmp_path_factory.mktemp("run"), model)
    folder = str(tmp_path_factory.mktemp("export") / "hf")
    export_hf.main(["--checkpoint", checkpoint, "--hf-dir", folder])
    return folder, model, checkpoint


def test_the_folder_holds_a_gpt2_model_and_its_tokenizer(exported):
    folder, model, _ = exported
    for name in ("config.json", "model.safetensors", "vocab.json", "merges.txt", "tokenizer.json",
                 "tokenizer_config.json"):
        assert os.path.isfile(os.path.join(folder, name)), name
    config = json.load(open(os.path.join(folder, "config.json")))
    assert config["model_type"] == "gpt2" and config["activation_function"] == "gelu"
    assert (config["vocab_size"], config["n_positions"], config["n_layer"], config["n_embd"]) == (GPT2_VOCAB, 32, 2, 32)
    assert not os.path.exists(folder + ".tmp")


def test_exported_logits_equal_ours_in_fp32(exported):
    """On a batch of random tokens, HF's logits over the 50257 tokens are ours (the padded rows cut)."""
    folder, model, _ = exported
    hf = transformers.GPT2LMHeadModel.from_pretrained(folder).eval()
    assert hf.lm_head.weight.data_ptr() == hf.transformer.wte.weight.data_ptr()  # still tied
    idx = torch.randint(0, GPT2_VOCAB, (3, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = gpt2_logits(model, idx)[..., :GPT2_VOCAB]
        theirs = hf(idx).logits
    assert theirs.dtype == torch.float32 and theirs.shape == ours.shape
    scale = ours.abs().max()
    assert scale > 1  # logits far from uniform: a wrong mapping would show
    torch.testing.assert_close(theirs, ours, rtol=RELATIVE_TOLERANCE, atol=RELATIVE_TOLERANCE * scale.item())


def test_generate_runs_and_greedy_matches_ours(exported):
    folder, model, _ = exported
    hf = transformers.GPT2LMHeadModel.from_pretrained(folder).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    context = [EOT] + tokenizer("The quick brown fox")["input_ids"]  # sample.py's context
    assert tokenizer("<|endoftext|>The quick brown fox")["input_ids"] == context  # docs/checkpoints.md's recipe for it
    with torch.no_grad():
        out = hf.generate(torch.tensor([context]), max_new_tokens=10, do_sample=False, pad_token_id=EOT)
    ours = sample.generate(model, context, 1, 10, temperature=0)
    assert out.shape[1] > len(context)
    assert out[0].tolist() == ours[0, :out.shape[1]].tolist()
    assert tokenizer.decode(out[0, 1:]).startswith("The quick brown fox")


def vocabulary_texts(encoding):
    """The text of every token whose bytes are valid UTF-8 (49,912 of the 50,256)."""
    texts = []
    for token in range(encoding.eot_token):
        try:
            texts.append(encoding.decode_single_token_bytes(token).decode("utf-8"))
        except UnicodeDecodeError:
            pass
    return texts


def random_texts(encoding, n=200, length=40):
    """Texts of random token runs: merges meeting at token boundaries, odd whitespace and bytes."""
    generator = torch.Generator().manual_seed(0)
    return [encoding.decode(torch.randint(0, encoding.eot_token, (length,), generator=generator).tolist())
            for _ in range(n)]


@pytest.mark.parametrize("files", ["tokenizer.json", "vocab.json + merges.txt"])
def test_the_exported_tokenizer_encodes_as_tiktoken(exported, tmp_path, files):
    """The real test of the recovered merges: the same ids as tiktoken on a paragraph (unicode,
    whitespace runs), on every token's own text and on random token runs; decoding gives the text
    back. Checked for tokenizer.json and for the classic vocab.json + merges.txt alone."""
    folder = exported[0]
    if files != "tokenizer.json":
        folder = str(tmp_path / "classic")
        os.makedirs(folder)
        for name in ("vocab.json", "merges.txt"):
            shutil.copy(os.path.join(exported[0], name), folder)
    tokenizer = transformers.GPT2Tokenizer.from_pretrained(folder)
    encoding = gpt2_encoding()[0]
    ids = tokenizer(PARAGRAPH)["input_ids"]
    assert ids == encoding.encode_ordinary(PARAGRAPH)
    assert tokenizer.decode(ids) == PARAGRAPH
    texts = vocabulary_texts(encoding) + random_texts(encoding)
    assert tokenizer(texts)["input_ids"] == encoding.encode_ordinary_batch(texts)
    assert tokenizer("<|endoftext|>")["input_ids"] == [EOT]


def test_merges_are_gpt2s():
    vocab, merges = export_hf.tokenizer_tables(gpt2_encoding()[0])
    assert len(vocab) == GPT2_VOCAB and len(merges) == 50000
    assert merges[:4] == ["Ġ t", "Ġ a", "h e", "i n"]  # the first lines of OpenAI's merges.txt
    assert vocab["Ġthe"] == 262 and vocab["<|endoftext|>"] == EOT


def test_a_trained_checkpoint_exports_and_verifies(tmp_path):
    """The trainer's own checkpoint (split-QKV assignment) passes the export's logit and token
    check, and the folder's logits are those of the trainer's GPT built here from the checkpoint's
    flags and state dict (not through training.model_io, which the export itself uses)."""
    run_dir = train_checkpoints(make_shards(str(tmp_path / "data")), tmp_path / "run")
    _, payload = find_checkpoint(out_dir=run_dir)
    difference = export_hf.export(payload, str(tmp_path / "hf"), gpt2_encoding()[0], verify=True)
    assert difference <= RELATIVE_TOLERANCE
    flags = payload["args"]
    model = GPT(GPTConfig(flags["n_layer"], flags["n_head"], flags["n_embd"], flags["seq_len"],
                          flags["vocab_size"]))
    model.load_state_dict(payload["model"])
    hf = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf")).eval()
    idx = torch.randint(0, GPT2_VOCAB, (3, flags["seq_len"]), generator=torch.Generator().manual_seed(1))
    ours = trainer_logits(model.eval(), idx, GPT2_VOCAB)
    with torch.no_grad():
        theirs = hf(idx).logits
    scale = ours.abs().max()
    assert scale > 0.1  # two steps from GPT-2's init: small logits, still far above the tolerance's rounding
    torch.testing.assert_close(theirs, ours, rtol=RELATIVE_TOLERANCE, atol=RELATIVE_TOLERANCE * scale.item())


def test_refusals_are_one_error_line(exported, tmp_path, capsys):
    folder, _, checkpoint = exported
    cases = [(["--checkpoint", checkpoint, "--hf-dir", folder], "not empty"),
             (["--checkpoint", write_checkpoint(tmp_path / "v64", tiny_model(vocab_size=64)), "--hf-dir",
               str(tmp_path / "x")], "64 embedding rows")]
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    cases.append((["--checkpoint", checkpoint, "--hf-dir", str(tmp_path / "other"), "--overwrite"], "not an export"))
    for argv, message in cases:
        with pytest.raises(SystemExit) as stop:
            run_cli(export_hf.main, argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert stop.value.code == 2 and len(err) == 1 and message in err[0], err
    assert (tmp_path / "other" / "notes.txt").read_text() == "mine"


def test_overwrite_replaces_an_earlier_export(exported, tmp_path):
    _, model, checkpoint = exported
    folder = str(tmp_path / "hf")
    export_hf.main(["--checkpoint", checkpoint, "--hf-dir", folder, "--no-verify"])
    other = tiny_model(n_layer=2, n_head=2, n_embd=32, seq_len=32, seed=1)
    export_hf.main(["--checkpoint", write_checkpoint(tmp_path / "other", other), "--hf-dir", folder, "--overwrite"])
    hf = transformers.GPT2LMHeadModel.from_pretrained(folder)
    assert torch.equal(hf.transformer.wpe.weight, other.wpe.weight)


def test_a_wrong_mapping_is_caught_and_leaves_no_folder(exported, tmp_path, monkeypatch):
    """The export's own check: HF's exact GELU swapped for the tanh one ("gelu_new") is refused."""
    _, payload = find_checkpoint(checkpoint=exported[2])
    right = export_hf.hf_config
    monkeypatch.setattr(export_hf, "hf_config", lambda cfg: right(cfg).__class__(
        **{**right(cfg).to_dict(), "activation_function": "gelu_new"}))
    folder = tmp_path / "hf"
    with pytest.raises(export_hf.UserError, match="logits differ"):
        export_hf.export(payload, str(folder), gpt2_encoding()[0])
    assert not folder.exists() and not (tmp_path / "hf.tmp").exists()
