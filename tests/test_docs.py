"""The pages agree with the code and with each other: docs/flags.md lists every flag of the trainer's
--help with its default and no flag it lacks; every relative link of README.md, docs/ and bench/
leads to a file (and a heading, where it names one); docs/README.md indexes every page; bench/README.md
names every script of bench/."""
import glob
import os
import re

import pytest

import train_gpt2

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS_PAGE = os.path.join(ROOT, "docs", "flags.md")
PAGES = [os.path.join(ROOT, "README.md"), *glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True),
         *glob.glob(os.path.join(ROOT, "bench", "*.md"))]


def flag_table(text):
    """[(flags, defaults)] of the rows of the page's tables whose first cell names flags: the
    `--flag` spans of the first cell, and the second cell split on ", " (one default per flag, or
    one for all)."""
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`--"):
            continue
        flags = re.findall(r"--[a-z0-9-]+", cells[0])
        rows.append((flags, cells[1]))
    return rows


def documented_defaults(text):
    """{flag: default text} of flags.md's tables."""
    out = {}
    for flags, default in flag_table(text):
        parts = [p.strip() for p in default.split(", ")]
        for i, flag in enumerate(flags):
            out[flag] = parts[i] if len(parts) == len(flags) else default
    return out


def same_default(text, value):
    """Whether a page's default cell says `value` (argparse's default): `off`/`on` for booleans,
    `none` (or a sentence) for None and empty lists, numbers by value, words as written."""
    said = re.sub(r"\s*\(.*\)$", "", text.replace("`", "")).strip()  # "0 (off)" -> "0"
    if isinstance(value, bool):
        return said == ("on" if value else "off")
    if value is None or value == []:
        return not re.fullmatch(r"-?[0-9.e+-]+", said)  # "none", "--model's", "the solver's defaults"
    if isinstance(value, (int, float)):
        try:
            return float(said) == float(value)
        except ValueError:
            return False
    return said == str(value)


def parser_flags():
    """{option string: default} of every option of the trainer's parser but -h/--help."""
    flags = {}
    for action in train_gpt2.build_parser()._actions:
        for option in action.option_strings:
            if option.startswith("--") and option != "--help":
                flags[option] = action.default
    return flags


def test_flags_page_lists_every_flag_of_help_with_its_default_and_nothing_else():
    documented = documented_defaults(open(FLAGS_PAGE).read())
    flags = parser_flags()
    missing = sorted(set(flags) - set(documented))
    assert not missing, f"flags of --help missing from docs/flags.md's table: {missing}"
    stale = sorted(set(documented) - set(flags))
    assert not stale, f"docs/flags.md documents flags --help no longer has: {stale}"
    wrong = {flag: (documented[flag], flags[flag]) for flag in flags if not same_default(documented[flag], flags[flag])}
    assert not wrong, f"docs/flags.md's defaults differ from --help's (page, --help): {wrong}"


def test_the_flag_check_sees_a_missing_flag_a_stale_flag_and_a_wrong_default():
    text = open(FLAGS_PAGE).read()
    documented = documented_defaults(text)
    assert "--muon-lr" in documented and "--no-fsdp" in documented
    assert not same_default("0.05", 0.02) and same_default("0.02", 0.02) and same_default("`online`", "online")
    assert not same_default("on", False) and same_default("0 (off)", 0.0)
    without = documented_defaults(re.sub(r"^\| `--muon-lr` .*$", "", text, flags=re.M))
    assert "--muon-lr" not in without


def github_anchor(heading):
    """The anchor GitHub gives a markdown heading: lower case, punctuation but - and _ dropped,
    spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path):
    text = re.sub(r"```.*?```", "", open(path).read(), flags=re.S)  # comments in code blocks are no headings
    return {github_anchor(h) for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}


def links(path):
    """[(line, target)] of the page's relative markdown links and images, code blocks left out."""
    found, block = [], False
    for number, line in enumerate(open(path).read().splitlines(), 1):
        if line.strip().startswith("```"):
            block = not block
            continue
        if block:
            continue
        for target in re.findall(r"\]\(([^)\s]+)\)", re.sub(r"`[^`]*`", "", line)):
            if not re.match(r"[a-z]+:", target):
                found.append((number, target))
    return found


@pytest.mark.parametrize("page", PAGES, ids=[os.path.relpath(p, ROOT) for p in PAGES])
def test_every_relative_link_leads_to_a_file_and_heading(page):
    broken = []
    for number, target in links(page):
        path, _, anchor = target.partition("#")
        full = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
        if not os.path.exists(full):
            broken.append(f"line {number}: {target} (no such file)")
        elif anchor and full.endswith(".md") and anchor not in anchors(full):
            broken.append(f"line {number}: {target} (no such heading)")
    assert not broken, f"{os.path.relpath(page, ROOT)}: {broken}"


def test_the_docs_index_links_every_page():
    index = os.path.join(ROOT, "docs", "README.md")
    linked = {os.path.normpath(os.path.join(ROOT, "docs", target.partition("#")[0])) for _, target in links(index)}
    pages = {os.path.normpath(p) for p in glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True)}
    # a folder's reports are reached through the write-up that cites them or the folder's link
    folders = {p for p in linked if os.path.isdir(p)}
    unlisted = sorted(os.path.relpath(p, ROOT) for p in pages - linked - {index}
                      if not any(p.startswith(folder + os.sep) for folder in folders))
    assert not unlisted, f"pages docs/README.md does not index: {unlisted}"


def test_bench_readme_names_every_tool_and_driver():
    text = open(os.path.join(ROOT, "bench", "README.md")).read()
    names = [os.path.relpath(p, os.path.join(ROOT, "bench")) for p in
             glob.glob(os.path.join(ROOT, "bench", "*.*")) + glob.glob(os.path.join(ROOT, "bench", "experiments", "*.*"))]
    unnamed = sorted(n for n in names if n.endswith((".py", ".sh")) and not n.endswith("__init__.py")
                     and f"`{os.path.basename(n)}`" not in text)
    assert not unnamed, f"bench/README.md says nothing of: {unnamed}"


def test_flags_page_names_the_solvers_default_scheme_as_the_default():
    from manifolds.plan import SolverOptions
    text = " ".join(open(FLAGS_PAGE).read().split())
    default = SolverOptions().scheme
    said = re.findall(r"`(\w+)`, the default", text)
    assert said and set(said) == {default}, f"docs/flags.md calls {said} the default scheme; it is {default}"


def test_readme_stays_a_front_page():
    # the two commands, the overview, the method and the headline results; details go to docs/
    lines = open(os.path.join(ROOT, "README.md")).read().count("\n")
    assert lines < 300, f"README.md has {lines} lines: move details into a docs/ page and link it"


def test_every_bench_command_named_in_the_pages_and_scripts_exists():
    # `python -m bench.X` and `bash bench/X.sh` in README, docs/, bench/ and run.sh: a module or
    # script that moved (bench/experiments/) without its references fails here
    sources = PAGES + glob.glob(os.path.join(ROOT, "bench", "**", "*.*"), recursive=True) + [os.path.join(ROOT, "run.sh")]
    missing = []
    for path in sources:
        if not path.endswith((".md", ".py", ".sh")):
            continue
        text = open(path).read()
        for module in set(re.findall(r"-m (bench(?:\.[a-z_0-9]+)+)\b(?!\.)", text)):  # not bench.NAME
            if not os.path.exists(os.path.join(ROOT, *module.split(".")) + ".py"):
                missing.append(f"{os.path.relpath(path, ROOT)}: python -m {module}")
        for script in set(re.findall(r"\b(bench/[a-z_0-9/]+\.(?:sh|py))\b", text)):  # not bench/X.py
            if not os.path.exists(os.path.join(ROOT, script)):
                missing.append(f"{os.path.relpath(path, ROOT)}: {script}")
    assert not missing, missing


@pytest.mark.parametrize("driver", sorted(glob.glob(os.path.join(ROOT, "bench", "experiments", "*.sh"))),
                         ids=lambda p: os.path.relpath(p, ROOT))
def test_an_experiment_driver_runs_from_the_repository_root(driver):
    up = re.search(r'^cd "\$\(dirname "\$0"\)/([./]+)"', open(driver).read(), flags=re.M)
    assert up, f"{driver}: no cd to the repository root"
    assert os.path.normpath(os.path.join(os.path.dirname(driver), up.group(1))) == ROOT
