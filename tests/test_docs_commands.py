"""Every torchrun command in README.md and docs/*.md runs as written: parsed with torchrun's own
argument parser, its training flags checked by the trainer's validate_args at the command's world
size (nodes x processes per node), and a multi-node one set up as several nodes need it (c10d
rendezvous with an endpoint and a job id, no --node_rank, which c10d ignores, and
TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: train_gpt2.attempt_store). A doc edit that breaks one fails here."""
import glob
import os
import re
import shlex

import pytest

import train_gpt2
from errors import UserError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = [os.path.join(ROOT, "README.md"), *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]
SEPARATORS = {"&&", "||", ";", "|"}


def torchrun_commands(path):
    """[(where, {env}, [torchrun's arguments])] of the torchrun commands in a markdown file's fenced
    code blocks (continuation lines joined; an environment assignment before torchrun kept)."""
    found, block, lines = [], False, open(path).read().splitlines()
    logical, start = "", 0
    for number, line in enumerate(lines, 1):
        if line.strip().startswith("```"):
            block, logical = not block, ""
            continue
        if not block:
            continue
        if not logical:
            start = number
        logical += line.rstrip().removesuffix("\\") + " "
        if line.rstrip().endswith("\\"):
            continue
        text, logical = logical, ""
        if "torchrun" not in text:
            continue
        tokens = shlex.split(text, comments=True)
        while "torchrun" in tokens:
            at = tokens.index("torchrun")
            env = {}
            for token in reversed(tokens[:at]):  # VAR=value prefixes of this command only
                if token in SEPARATORS or not re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", token):
                    break
                key, _, value = token.partition("=")
                env[key] = value
            rest = tokens[at + 1:]
            end = next((i for i, t in enumerate(rest) if t in SEPARATORS), len(rest))
            found.append((f"{os.path.relpath(path, ROOT)}:{start}", env, rest[:end]))
            tokens = rest[end:]
    return found


COMMANDS = [command for path in DOCS for command in torchrun_commands(path)]


def world_sizes(torchrun):
    """The world sizes a parsed torchrun command can run at: nodes (N or MIN:MAX) x processes."""
    nodes = [int(n) for n in torchrun.nnodes.split(":")]
    return sorted({n * int(torchrun.nproc_per_node) for n in nodes})


def test_the_docs_hold_the_multi_node_commands_checked_here():
    multi = [where for where, _, args in COMMANDS if any(a.startswith("--nnodes") for a in args)]
    assert {where.split(":")[0] for where in multi} >= {"README.md", os.path.join("docs", "distributed.md")}, multi
    assert len(COMMANDS) >= 8, [where for where, _, _ in COMMANDS]


def documented_files(paths):
    """{name: text} of the fenced python blocks whose first line is `# NAME.py: ...` (the README's
    my_manifold.py): files the commands beside them use."""
    files = {}
    for path in paths:
        for block in re.findall(r"```python\n(.*?)```", open(path).read(), flags=re.S):
            named = re.match(r"# (\S+\.py):", block)
            if named:
                files[named.group(1)] = block
    return files


def flag_values(script, flag):
    return [script[i + 1] for i, token in enumerate(script[:-1]) if token == flag]


@pytest.fixture
def in_scratch_folder(tmp_path, monkeypatch):
    """The command's folder: the documented files written there; the manifolds a command's
    --manifold-module registers forgotten afterwards (the registry is this process's)."""
    from manifolds.geometry import MANIFOLDS
    from training import user_manifolds
    for name, text in documented_files(DOCS).items():
        (tmp_path / name).write_text(text)
    monkeypatch.chdir(tmp_path)
    manifolds, loaded = dict(MANIFOLDS), set(user_manifolds._LOADED)
    yield tmp_path
    MANIFOLDS.clear()
    MANIFOLDS.update(manifolds)
    user_manifolds._LOADED.clear()
    user_manifolds._LOADED.update(loaded)


@pytest.mark.parametrize("where, env, args", COMMANDS, ids=[where for where, _, _ in COMMANDS])
def test_a_documented_torchrun_command_passes_the_trainers_checks_at_its_world_size(where, env, args,
                                                                                    in_scratch_folder):
    import json

    from torch.distributed.run import get_args_parser
    torchrun = get_args_parser().parse_args(args)
    assert os.path.basename(torchrun.training_script) == "train_gpt2.py", where
    script = list(torchrun.training_script_args)
    if "$" in " ".join(script):
        pytest.skip(f"{where}: a shell variable in the command")
    # a --resume of a run an earlier command of the same page started: its config.json, as that
    # run wrote it (the --manifold-module list it brings back)
    out_dir = (flag_values(script, "--out-dir") or [None])[0]
    if "--resume" in script and out_dir and not os.path.isabs(out_dir):
        page = where.split(":")[0]
        started = [other for w, _, other in COMMANDS if w.split(":")[0] == page and int(w.split(":")[1]) <
                   int(where.split(":")[1]) and out_dir in flag_values(other, "--out-dir")]
        modules = [os.path.abspath(m) for other in started for m in flag_values(other, "--manifold-module")]
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            json.dump({"manifold_module": modules}, f)
    for world in world_sizes(torchrun):
        parsed = train_gpt2.parse_args(script)
        try:
            train_gpt2.validate_args(parsed, world_size=world)
        except UserError as err:
            pytest.fail(f"{where}: at {world} processes: error: {err}")
    if int(torchrun.nnodes.split(":")[-1]) > 1:
        given = {a.split("=")[0].replace("_", "-") for a in args if a.startswith("--")}
        assert torchrun.rdzv_backend == "c10d", f"{where}: several nodes need --rdzv-backend=c10d"
        assert torchrun.rdzv_endpoint and "--rdzv-endpoint" in given, f"{where}: no --rdzv-endpoint"
        assert "--rdzv-id" in given and torchrun.rdzv_id != "none", f"{where}: no --rdzv-id for the job"
        assert "--node-rank" not in given, f"{where}: --node_rank, which c10d rendezvous ignores"
        assert env.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") == "1", \
            f"{where}: several nodes need TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (train_gpt2.attempt_store)"
