"""training/model_io.py: checkpoints back into a GPT, and the logits GPT.forward does not return."""
import os

import pytest
import torch
import torch.nn.functional as F

from errors import UserError
from synthetic import make_shards
from tiny_gpt import tiny_model, train_checkpoints, write_checkpoint
from training.checkpoints import load_checkpoint
from training.model_io import GPT2_VOCAB, find_checkpoint, gpt2_logits, load_model, logits


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    data_dir = make_shards(str(tmp_path_factory.mktemp("data")))
    return train_checkpoints(data_dir, tmp_path_factory.mktemp("run"))


def test_logits_are_the_forward_pass_of_the_model():
    """Cross-entropy of the helper's logits equals GPT.forward's loss: the same computation."""
    model = tiny_model(vocab_size=256)
    idx = torch.randint(0, 256, (3, 32), generator=torch.Generator().manual_seed(0))
    targets = torch.randint(0, 256, (3, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = F.cross_entropy(logits(model, idx).view(-1, 256), targets.view(-1))
        torch.testing.assert_close(ours, model(idx, targets), rtol=1e-6, atol=1e-6)


def test_padded_vocabulary_rows_are_minus_infinity():
    model = tiny_model()
    out = gpt2_logits(model, torch.tensor([[1, 2, 3]]))
    assert out.shape == (1, 3, 50304)
    assert torch.isneginf(out[..., GPT2_VOCAB:]).all() and torch.isfinite(out[..., :GPT2_VOCAB]).all()


def test_a_trained_checkpoint_loads_into_the_same_weights(run_dir):
    """The trainer's checkpoint (split-QKV assignment, fused QKV in the state dict) rebuilds its model."""
    path, payload = find_checkpoint(out_dir=run_dir)
    assert os.path.basename(path) == "ckpt_00000002.pt"
    model = load_model(payload)
    assert (model.cfg.n_layer, model.cfg.n_embd, model.cfg.vocab_size) == (1, 32, 50304)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, payload["model"][name]), name
    assert model.lm_head.weight is model.wte.weight  # still tied after loading


def test_the_newest_checkpoint_that_loads_is_taken(run_dir, tmp_path):
    for name in ("ckpt_00000001.pt", "ckpt_00000002.pt"):
        for suffix in ("", ".sha256"):
            with open(os.path.join(run_dir, name + suffix), "rb") as src, open(tmp_path / (name + suffix), "wb") as dst:
                dst.write(src.read())
    with open(tmp_path / "ckpt_00000002.pt", "r+b") as f:  # one byte changed: corrupt by its manifest
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 1]))
    skipped = []
    path, _ = find_checkpoint(out_dir=str(tmp_path), say=skipped.append)
    assert path.endswith("ckpt_00000001.pt") and "corrupt" in skipped[0]


def test_wrapper_prefixes_are_removed(tmp_path):
    model = tiny_model(vocab_size=128)
    payload = load_checkpoint(write_checkpoint(tmp_path, model))
    payload["model"] = {f"_orig_mod.{k}": v for k, v in payload["model"].items()}
    loaded = load_model(payload)
    assert torch.equal(loaded.wte.weight, model.wte.weight)


def test_user_mistakes_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="no such file"):
        find_checkpoint(checkpoint=str(tmp_path / "none.pt"))
    with pytest.raises(UserError, match="no checkpoint that loads"):
        find_checkpoint(out_dir=str(tmp_path))
    payload = load_checkpoint(write_checkpoint(tmp_path, tiny_model(vocab_size=128)))
    payload["args"]["n_embd"] = 64
    with pytest.raises(UserError, match="do not fit"):
        load_model(payload)
