"""sample.py: continuations of a prompt, deterministic per seed, within the model's context."""
import os

import pytest
import torch

import sample
from data.bpe import gpt2_encoding
from errors import run_cli
from tiny_gpt import tiny_model, trainer_logits, write_checkpoint
from training.model_io import EOT, GPT2_VOCAB

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("run"), tiny_model())


def texts(*argv):
    return sample.sample(sample.parse_args(list(argv)), say=lambda *a: None)


def test_samples_continue_the_prompt_and_depend_only_on_the_seed(checkpoint):
    flags = ("--checkpoint", checkpoint, "--prompt", PROMPT, "--num-samples", "2", "--max-new-tokens", "12")
    first = texts(*flags, "--seed", "1")
    assert len(first) == 2
    for text in first:
        assert text.startswith(PROMPT) and len(text) > len(PROMPT)
    assert texts(*flags, "--seed", "1") == first
    assert texts(*flags, "--seed", "2") != first
    assert first[0] != first[1]  # two draws, not one repeated


def test_a_run_folder_gives_its_newest_checkpoint(checkpoint):
    """--out-dir DIR reads the same checkpoint as --checkpoint DIR/ckpt_<step>.pt (the only one there)."""
    flags = ("--prompt", PROMPT, "--num-samples", "1", "--max-new-tokens", "6", "--seed", "3")
    assert texts("--out-dir", os.path.dirname(checkpoint), *flags) == texts("--checkpoint", checkpoint, *flags)


def test_greedy_decoding_is_the_argmax_chain(checkpoint):
    """--temperature 0 picks the most likely token each step: the text is the prompt followed by
    the chain of argmaxes of the model's own logits (computed here, one full forward per token),
    for any seed."""
    flags = ("--checkpoint", checkpoint, "--prompt", PROMPT, "--num-samples", "1", "--temperature", "0",
             "--max-new-tokens", "20")  # within the 32-token context: no cropping
    [text] = texts(*flags, "--seed", "1")
    assert texts(*flags, "--seed", "2") == [text]
    model = tiny_model()  # the checkpoint's weights
    encoding, _ = gpt2_encoding()
    prompt = encoding.encode(PROMPT)
    chain = argmax_chain(model, [EOT] + prompt, 20)
    if EOT in chain:
        chain = chain[:chain.index(EOT)]
    assert len(chain) >= 5
    assert text == encoding.decode_bytes(prompt + chain).decode("utf-8", errors="replace")
    # this random model's greedy chains repeat their first token: the first tokens after other
    # contexts differ, so each is an argmax of logits that depend on the context
    g = torch.Generator().manual_seed(0)
    contexts = [[EOT] + torch.randint(0, GPT2_VOCAB - 1, (6,), generator=g).tolist() for _ in range(4)]
    chains = [argmax_chain(model, context, 6) for context in contexts]
    assert len({c[0] for c in chains}) == 4
    for context, want in zip(contexts, chains, strict=True):
        assert sample.generate(model, context, 1, 6, temperature=0)[0, len(context):].tolist() == want


def argmax_chain(model, context, n):
    """n tokens, each the argmax of trainer_logits over the whole sequence so far."""
    idx = torch.tensor([context])
    for _ in range(n):
        top2, top = trainer_logits(model, idx, GPT2_VOCAB)[0, -1].topk(2)
        assert top2[0] - top2[1] > 1e-4  # no near-tie the two computations could break differently
        idx = torch.cat([idx, top[:1].view(1, 1)], dim=1)
    return idx[0, len(context):].tolist()


def test_a_context_longer_than_the_model_sees_is_cropped_to_its_last_tokens():
    """Generation past seq_len works, and depends only on the last seq_len tokens."""
    model = tiny_model(seq_len=16)
    long_context = torch.randint(0, GPT2_VOCAB - 1, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    full = sample.generate(model, long_context, 1, 10, temperature=0)
    cropped = sample.generate(model, long_context[-16:], 1, 10, temperature=0)
    assert full.shape == (1, 50)
    assert full[0, 40:].tolist() == cropped[0, 16:].tolist()


def favour(model, rows):
    """An untied head with a large bias on `rows`: those tokens become the most likely by far."""
    head = torch.nn.Linear(model.cfg.n_embd, model.cfg.vocab_size)
    with torch.no_grad():
        head.weight.copy_(model.wte.weight)
        head.bias.zero_()
        head.bias[rows] = 1e4
    model.lm_head = head
    return model


def test_padded_vocabulary_rows_are_never_sampled():
    """Rows 50257.., made the most likely by far, still never come out."""
    model = favour(tiny_model(), slice(GPT2_VOCAB, None))
    out = sample.generate(model, [EOT], 4, 8, temperature=1.0, top_k=0,
                          generator=torch.Generator().manual_seed(0))
    assert out.max().item() < GPT2_VOCAB


def test_a_sample_ends_at_end_of_text():
    model = favour(tiny_model(), EOT)  # end-of-text made certain
    out = sample.generate(model, [EOT, 464], 2, 20, temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert out.shape == (2, 3) and (out[:, 2] == EOT).all()
    from data.bpe import gpt2_encoding
    assert sample.sample_text(gpt2_encoding()[0], [464], out[0, 2:].tolist()) == "The"


def test_cli_prints_each_sample_and_a_separator(checkpoint, capsys):
    sample.main(["--checkpoint", checkpoint, "--prompt", PROMPT, "--num-samples", "2", "--max-new-tokens", "5"])
    captured = capsys.readouterr()
    assert captured.out.count(sample.SEPARATOR) == 2 and captured.out.startswith(PROMPT)
    assert "step 7, assign hetero" in captured.err


@pytest.mark.parametrize("flags, message", [
    (["--temperature", "-1"], "--temperature must be"),
    (["--top-k", "-3"], "--top-k must be"),
    (["--num-samples", "0"], "--num-samples must be positive"),
])
def test_bad_flags_are_one_error_line(checkpoint, capsys, flags, message):
    with pytest.raises(SystemExit) as stop:
        run_cli(sample.main, ["--checkpoint", checkpoint, *flags])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0]


def test_a_checkpoint_without_the_gpt2_vocabulary_is_refused(tmp_path, capsys):
    path = write_checkpoint(tmp_path, tiny_model(vocab_size=64))
    with pytest.raises(SystemExit):
        run_cli(sample.main, ["--checkpoint", path])
    assert "64 embedding rows" in capsys.readouterr().err


def test_help_explains_every_flag(capsys):
    with pytest.raises(SystemExit):
        sample.parse_args(["--help"])
    out = capsys.readouterr().out
    for flag in ("--checkpoint", "--out-dir", "--prompt", "--num-samples", "--max-new-tokens", "--temperature",
                 "--top-k", "--seed", "--device", "--bpe-file"):
        assert flag in out
