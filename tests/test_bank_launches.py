"""bench/cost_model.py --bank-launches: the launches a bank adds to one rank's step, the fixed cost
per bank an owner pays whatever its number of pieces (exchange.bucket_owners' question)."""
import json

import pytest
import torch

from bench import cost_model


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _run(tmp_path, name, *flags):
    path = tmp_path / f"{name}.json"
    status = cost_model.main(["--n-layer", "2", "--n-embd", "64", "--world-size", "4", "--fake-only",
                              "--out", str(path), *flags])
    return status, json.loads(path.read_text())


def test_bank_launches_per_bank_and_per_call_and_the_counts_unchanged(tmp_path, capsys):
    from manifolds import exchange
    owners = exchange.bucket_owners
    status, data = _run(tmp_path, "banks", "--bank-launches")
    assert status == 0 and exchange.bucket_owners is owners  # patched only while counting
    banks = data["bank_launches"]
    assert banks["world_size"] == 4 and banks["none"] > 0
    # 2 layers at 4 ranks, DDP's buckets: the 4 MLP pieces (one DGram bank), then QKV + attention
    # projection (2 + 2 Stiefel pieces, two banks in one solver call)
    assert [len(bucket["banks"]) for bucket in banks["buckets"]] == [1, 2]
    assert banks["buckets"][0]["together"] is None
    for bucket in banks["buckets"]:
        assert all(n > 0 for n in bucket["banks"].values())
    two = banks["buckets"][1]
    # one call of both banks: more than either alone, less than both alone (the call's own launches once)
    assert max(two["banks"].values()) < two["together"] < sum(two["banks"].values())
    printed = capsys.readouterr().out
    assert "one of each, in one solver call" in printed
    # the step's own counts are those of a run without the flag
    _, plain = _run(tmp_path, "plain")
    assert "bank_launches" not in plain
    keys = ("launches", "flops_by_precision", "collective_bytes_sent", "pieces")
    for a, b in zip(data["world_size"]["4"]["ranks"], plain["world_size"]["4"]["ranks"], strict=True):
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}


def test_bank_launches_needs_a_world_size_above_one(capsys):
    with pytest.raises(SystemExit):
        cost_model.parse_args(["--bank-launches", "--world-size", "1"])
    assert "--bank-launches needs a world size above 1" in capsys.readouterr().err
