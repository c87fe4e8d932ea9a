"""--assign presets and custom specs."""
import pytest

from errors import UserError
from manifolds.assignment import PRESETS, parse_assignment


def test_presets_match_the_paper_table():
    assert parse_assignment("unconstrained") == dict.fromkeys(
        ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj"), "none")
    hetero = parse_assignment("hetero")
    assert hetero == {"attn.qkv": "stiefel", "attn.proj": "stiefel", "mlp.fc": "dgram", "mlp.proj": "dgram"}
    inv = parse_assignment("hetero-inv")
    assert inv == {"attn.qkv": "dgram", "attn.proj": "dgram", "mlp.fc": "stiefel", "mlp.proj": "stiefel"}
    assert set(parse_assignment("all-stiefel").values()) == {"stiefel"}
    assert set(parse_assignment("all-dgram").values()) == {"dgram"}
    assert set(parse_assignment("all-oblique").values()) == {"oblique"}
    assert parse_assignment("hetero-hyperball") == {"attn.qkv": "stiefel", "attn.proj": "stiefel",
                                                    "mlp.fc": "hyperball", "mlp.proj": "hyperball"}
    assert set(parse_assignment("all-hyperball").values()) == {"hyperball"}
    assert set(PRESETS) == {"unconstrained", "all-stiefel", "all-dgram", "hetero", "hetero-inv", "hetero-qk",
                            "all-oblique", "hetero-hyperball", "all-hyperball"}


def test_custom_spec_later_entries_override_and_unnamed_stay_none():
    spec = parse_assignment("attn=dgram,attn.qkv=stiefel, mlp.fc = dgram")
    assert spec == {"attn.qkv": "stiefel", "attn.proj": "dgram", "mlp.fc": "dgram", "mlp.proj": "none"}


@pytest.mark.parametrize("bad", ["hetro", "attn=sphere", "attention=stiefel", "attn", "", " , "])
def test_invalid_specs_name_the_valid_choices(bad):
    with pytest.raises(UserError) as err:
        parse_assignment(bad)
    message = str(err.value)
    assert "hetero" in message and "stiefel" in message and "mlp.proj" in message
