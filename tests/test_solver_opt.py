"""train_gpt2.py's one route for the solver's settings, --solver-opt KEY=VALUE: its keys are the
fields of SolverOptions (less those with a flag of their own), every value reaches the optimizer as
the old per-setting flags' values did, and a bad item is one error line."""
import pytest
import torch

import train_gpt2
from manifolds.plan import show_value, solver_value_kind
from errors import UserError, run_cli
from model import GPT, GPTConfig
from training.checkpoints import checkpoint_payload, restore

BASE = ["--assign", "hetero", "--n-layer", "1", "--n-embd", "32", "--n-head", "2"]
DEFAULTS = train_gpt2.solver_opt_defaults()
INT_KEY = next(k for k, v in DEFAULTS.items() if solver_value_kind(k, v) == "int")


def build(*flags):
    args = train_gpt2.parse_args([*BASE, *flags])
    train_gpt2.validate_args(args, world_size=1)
    torch.manual_seed(0)
    model = GPT(GPTConfig(1, 2, 32, 16, 64))
    muon, adamw = train_gpt2.build_optimizers(model, args, torch.device("cpu"))
    return model, muon, adamw, args


def other_value(key, default):
    """(text, parsed) of a value of `key` other than its default that the solver accepts; None for
    a name (its valid names are the solver's business)."""
    kind = solver_value_kind(key, default)
    if kind == "switch":
        return ("off", False) if default else ("on", True)
    if kind == "auto-or-switch":
        return "on", True
    if kind == "int":
        return str(default + 1), default + 1
    if kind == "float":
        return repr(default / 2), default / 2
    return None


def test_help_lists_every_key_with_its_default_and_at_most_54_flags():
    # 48 until sharded training added --model, --fsdp and --fsdp-shard-ranks, 53 with
    # --manifold-module and --fsdp-grad-sync, 54 with --exchange-opt (the exchange's settings apart
    # from the solver's); solver knobs stay --solver-opt keys, not flags
    parser = train_gpt2.build_parser()
    flags = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    assert len(flags) <= 54, [a.option_strings[0] for a in flags]
    text = " ".join(parser.format_help().split())  # argparse wraps lines
    for key, default in DEFAULTS.items():
        assert f"{key}={show_value(default)}" in text
    assert set(DEFAULTS).isdisjoint(train_gpt2.SOLVER_FLAG_OPTIONS)


def test_every_key_reaches_the_optimizer():
    items = {key: other_value(key, default) for key, default in DEFAULTS.items()}
    items = {key: value for key, value in items.items() if value is not None}
    assert INT_KEY in items and "capturable" in items
    flags = [arg for key, (text, _) in items.items() for arg in ("--solver-opt", f"{key}={text}")]
    _, muon, _, args = build(*flags)
    assert args.solver_options == {key: parsed for key, (_, parsed) in items.items()}
    assert {key: getattr(muon.options, key) for key in items} == args.solver_options
    _, muon, _, _ = build()  # nothing given: the defaults
    assert all(getattr(muon.options, key) == default for key, default in DEFAULTS.items())
    _, muon, _, _ = build("--solver-precision", "bf16", "--kernels", "torch")  # the keys with flags of their own
    assert (muon.options.precision, muon.options.backend) == ("bf16", "torch")


@pytest.mark.parametrize("text, parsed", [("auto", "auto"), ("on", True), ("True", True), ("off", False),
                                          ("false", False)])
def test_capturable_takes_auto_or_a_switch(text, parsed):
    _, muon, _, _ = build("--solver-opt", f"capturable={text}")
    assert muon.options.capturable == parsed


@pytest.mark.parametrize("item, message", [
    ("nonsense=1", "unknown key 'nonsense'"),
    ("no-equals-sign", "unknown key"),
    (f"{INT_KEY}=two", f"{INT_KEY} takes a whole number, got 'two'"),
    (f"{INT_KEY}=1.5", f"{INT_KEY} takes a whole number"),
    (f"{INT_KEY}=-1", f"{INT_KEY} must be >= 0"),
    ("capturable=maybe", "capturable takes auto, on or off"),
    ("precision=fp32", "precision is set by --solver-precision"),
    ("backend=torch", "backend is set by --kernels"),
])
def test_a_bad_item_is_refused(item, message):
    with pytest.raises(UserError, match="--solver-opt") as err:
        build("--solver-opt", item)
    assert message in str(err.value)


def test_a_bad_item_is_one_error_line_naming_the_valid_keys(capsys):
    with pytest.raises(SystemExit) as exit_:
        run_cli(train_gpt2.main, [*BASE, "--solver-opt", "nonsense=1"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("error: --solver-opt nonsense=1")
    assert all(key in err for key in DEFAULTS)


def test_cuda_graph_reads_capturable_from_solver_opt():
    with pytest.raises(UserError, match="--cuda-graph needs the sync-free step: --solver-opt capturable=on"):
        build("--cuda-graph", "on", "--device", "cpu")
    with pytest.raises(UserError, match="--cuda-graph needs the sync-free step"):
        build("--cuda-graph", "on", "--solver-opt", "capturable=off")
    build("--cuda-graph", "on", "--solver-opt", "capturable=on")


def test_a_resumed_run_applies_its_own_solver_options():
    # the flags given to the resumed run win over the checkpoint's, and restore reports the difference
    before, after = DEFAULTS[INT_KEY] + 1, DEFAULTS[INT_KEY] + 2
    model, muon, adamw, args = build("--solver-opt", f"{INT_KEY}={before}")
    payload = checkpoint_payload(0, model, adamw, muon.state_dict(), {}, args)
    payload["rng"] = {"cpu": torch.get_rng_state(), "cuda": []}
    model, muon, adamw, args = build("--solver-opt", f"{INT_KEY}={after}", "--solver-precision", "tf32")
    assert restore(payload, model, adamw, muon, args) == {INT_KEY: (before, after), "precision": ("auto", "tf32")}
    assert (getattr(muon.options, INT_KEY), muon.options.precision) == (after, "tf32")
    model, muon, adamw, args = build("--solver-opt", f"{INT_KEY}={before}")
    assert restore(payload, model, adamw, muon, args) == {}


# --- the exchange's settings: --exchange-opt KEY=VALUE (manifolds/exchange.py's ExchangeOptions) ---

def test_exchange_settings_have_their_own_flag_and_reach_the_exchange():
    from manifolds.exchange import ExchangeOptions
    assert set(DEFAULTS).isdisjoint(ExchangeOptions.keys())  # not --solver-opt keys
    text = " ".join(train_gpt2.build_parser().format_help().split())
    for key in ExchangeOptions.keys():
        default = getattr(ExchangeOptions(), key)
        assert f"{key}={show_value(default)}" in text
    _, muon, _, args = build("--exchange-opt", "overlap=off", "--exchange-opt", "resident=on",
                             "--exchange-opt", "exchange_grad=bf16")
    assert args.exchange_options == {"overlap": False, "resident": True, "exchange_grad": "bf16"}
    assert muon.exchange.options == ExchangeOptions(overlap=False, exchange_grad="bf16", resident=True)
    assert muon.exchange.grad_dtype == torch.bfloat16
    assert build()[1].exchange.options == ExchangeOptions()


@pytest.mark.parametrize("item", ["resident=on", "overlap=off", "exchange_grad=bf16"])
def test_an_exchange_setting_given_to_solver_opt_names_exchange_opt(item):
    with pytest.raises(UserError, match=f"--exchange-opt {item}"):
        build("--solver-opt", item)


@pytest.mark.parametrize("item", ["resident=maybe", "nonsense=1", "exchange_grad=fp16", "overlap"])
def test_a_bad_exchange_opt_is_one_error_naming_it(item):
    with pytest.raises(UserError, match="--exchange-opt"):
        build("--exchange-opt", item)
