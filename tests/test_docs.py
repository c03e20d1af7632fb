"""The docs against the code: every command, flag and figure that README.md and docs/*.md give.

A user copies what the docs show, so each of it is read here and held against what it names:
``make TARGET`` against the Makefile's targets; ``make X VAR=...`` and ``VAR=... make X``
against the variables make passes on as the doc says (a plain ``VAR = ...`` in the Makefile
ignores the environment's); ``elastic-mnist CMD`` and ``python -m elastic_mnist CMD`` against
the CLI's subcommands; each ``--flag`` of a command line against the parser of the program it
is given to (torchrun's own flags against torchrun's parser, a script's against the script's);
docs/launching.md's "Commands and flags" against the CLI both ways, every train flag listed
with its default; the README's recovery tables against what scripts/recovery.py renders from
bench/recovery.json, docs/performance.md's against scripts/bench.py's from bench/results.json;
``make help`` against the Makefile's targets. All of it read from files: no launch.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import markers

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
ENV_ASSIGNMENT = re.compile(r"^([A-Z][A-Z0-9_]*)=(.*)$", re.DOTALL)
FLAG = re.compile(r"^(--?[A-Za-z][\w-]*)")
SHARE_VAR = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
SHARE_ANCHOR = "launching.md#torch_disable_share_rdzv_tcp_store"
"""Where the one explanation of SHARE_VAR is; every other page that speaks of it links there."""


# --- what the docs show ------------------------------------------------------------------------


@dataclass(frozen=True)
class Command:
    """One command line of a page: the variables set before it, and its words."""

    where: str
    env: dict[str, str]
    argv: list[str]

    def __str__(self) -> str:
        return f"{self.where}: {' '.join([*(f'{k}={v}' for k, v in self.env.items()), *self.argv])}"


def page_name(path: Path) -> str:
    return str(path.relative_to(REPO))


def snippets(path: Path) -> list[tuple[int, str]]:
    """The code of a page, each with the line it starts on: every line of its indented blocks
    (continuations joined, comments dropped) and every inline code span."""
    lines = path.read_text().splitlines()
    found, prose, after_blank, in_block = [], [], True, False
    pending, start = "", 0
    for number, line in enumerate(lines, 1):
        is_code = line.startswith("    ") and line.strip() and (after_blank or in_block)
        in_block = bool(is_code) or (in_block and not line.strip())
        after_blank = not line.strip()
        if not is_code:
            prose.append(line)
            continue
        prose.append("")
        code = re.sub(r"\s+#\s.*$", "", line.strip())
        if not pending:
            start = number
        pending += code
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        found.append((start, pending))
        pending = ""
    text = "\n".join(prose)
    for match in re.finditer(r"`([^`]+)`", text):
        found.append((text.count("\n", 0, match.start()) + 1, " ".join(match.group(1).split())))
    return found


def words(code: str) -> list[str]:
    try:
        return shlex.split(code)
    except ValueError:  # an unbalanced quote in a span that is not a command
        return code.split()


PROGRAMS = ("make", "torchrun", "elastic-mnist", "sbatch", "pytest")


def commands(path: Path) -> list[Command]:
    """The command lines of a page: a snippet's parts between ``;``, ``&&`` and ``|``, each
    starting (after its variables) with a program the project runs."""
    found = []
    for line, code in snippets(path):
        for part in re.split(r"\s(?:;|&&|\|\||\|)\s", code):
            argv = [w.strip("[]") for w in words(part) if w not in ("...", "…", "\\")]
            env = {}
            while argv and ENV_ASSIGNMENT.match(argv[0]):
                name, value = ENV_ASSIGNMENT.match(argv.pop(0)).groups()
                env[name] = value
            if argv and re.fullmatch(r"(\S*/)?python3?(\.\d+)?", argv[0]):
                argv.pop(0)
                if argv[:1] == ["-m"] and len(argv) > 1:
                    argv = [{"torch.distributed.run": "torchrun", "elastic_mnist": "elastic-mnist",
                             "pytest": "pytest"}.get(argv[1], argv[1]), *argv[2:]]
            if argv and (argv[0] in PROGRAMS or re.fullmatch(r"(scripts|jobs)/[\w./]+", argv[0])):
                found.append(Command(f"{page_name(path)}:{line}", env, argv))
    return found


@functools.cache
def all_commands() -> tuple[Command, ...]:
    return tuple(c for page in PAGES for c in commands(page))


def of(program: str) -> list[Command]:
    return [c for c in all_commands() if c.argv[0] == program]


def flags(argv: list[str]) -> list[str]:
    """The options among ``argv``: ``--name`` (without ``=value``) and ``-x``."""
    return [FLAG.match(w).group(1) for w in argv if FLAG.match(w)]


# --- what the code has -------------------------------------------------------------------------


def options(parser: argparse.ArgumentParser) -> set[str]:
    return {s for action in parser._actions for s in action.option_strings}


@functools.cache
def cli() -> dict[str, argparse.ArgumentParser]:
    from elastic_mnist.cli import build_parser

    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


@functools.cache
def torchrun_options() -> set[str]:
    from torch.distributed.run import get_args_parser

    return options(get_args_parser())


@functools.cache
def script_options(name: str) -> set[str]:
    """The options a script of scripts/ declares (every parser in it: a superset)."""
    source = (REPO / "scripts" / name).read_text()
    return set(re.findall(r"add_argument\(\s*(?:\"-\w\",\s*)?\"(--?[\w-]+)\"", source)) | \
        set(re.findall(r"add_argument\(\s*\"(-\w)\"", source)) | {"-h", "--help"}


@dataclass(frozen=True)
class Makefile:
    targets: set[str]
    phony: set[str]
    reads: set[str]
    """Variables the Makefile uses, ``$(VAR)``."""
    plain: set[str]
    """Variables set with ``=`` or ``:=``: make ignores the environment's value of them."""
    recipes: dict[str, str]
    """Each target's rule and recipe, continuations joined."""


@functools.cache
def makefile() -> Makefile:
    text = (REPO / "Makefile").read_text().replace("\\\n", " ")
    targets, recipes, current = set(), {}, None
    for line in text.splitlines():
        rule = re.match(r"^([A-Za-z0-9_-]+)\s*:(?!=)", line)
        if rule:
            current = rule.group(1)
            targets.add(current)
            recipes[current] = line
        elif line.startswith("\t") and current:
            recipes[current] += "\n" + line
        elif line.strip() and not line.startswith("#"):
            current = None
    (phony,) = re.findall(r"^\.PHONY:(.*)$", text, re.MULTILINE)
    return Makefile(targets=targets, phony=set(phony.split()),
                    reads=set(re.findall(r"\$[({]([A-Z_][A-Z0-9_]*)[)}]", text)),
                    plain={m.group(1) for m in
                           re.finditer(r"^([A-Z_][A-Z0-9_]*)\s*:?=", text, re.MULTILINE)},
                    recipes=recipes)


def named_in_the_code(name: str) -> bool:
    """A variable something of ours reads: the launch scripts, the scripts, the package."""
    files = [*(REPO / "jobs").rglob("*"), *(REPO / "scripts").glob("*"),
             *(REPO / "elastic_mnist").rglob("*.py")]
    return any(name in f.read_text(errors="replace") for f in files if f.is_file())


def args_program(variable: str) -> set[str] | None:
    """The options of what a ``*_ARGS`` variable of the Makefile is handed to."""
    for recipe in makefile().recipes.values():
        for line in recipe.splitlines():
            if f"$({variable})" not in line:
                continue
            script = re.search(r"scripts/(\w+\.py)", line)
            if script:
                return script_options(script.group(1))
            if "jobs/local.sh" in line:
                return options(cli()["train"])
    return None


# --- the checks --------------------------------------------------------------------------------


def test_the_pages_show_commands():
    """The reading above finds what it should: a guard against a parser that finds nothing."""
    programs = {c.argv[0] for c in all_commands()}
    assert {"make", "torchrun", "elastic-mnist", "scripts/chaos.py", "jobs/node.sh"} <= programs
    assert len(of("make")) > 30


def test_make_targets_and_variables_are_the_makefiles():
    """``make X`` names a target; ``make X VAR=v`` a variable it reads; ``VAR=v make X`` one that
    make takes from the environment (``HOST`` is taken from make's command line only)."""
    mk, wrong = makefile(), []
    for c in of("make"):
        for word in c.argv[1:]:
            assignment = ENV_ASSIGNMENT.match(word)
            if word.startswith("-"):
                continue
            if not assignment:
                if word not in mk.targets:
                    wrong.append(f"{c}: no target {word!r}")
                continue
            name, value = assignment.groups()
            if name not in mk.reads:
                wrong.append(f"{c}: the Makefile reads no {name}")
            if name.endswith("_ARGS"):
                known = args_program(name)
                wrong += [f"{c}: {name} goes to a program without {flag}"
                          for flag in flags(words(value)) if known is not None
                          and flag not in known]
        for name in c.env:
            if name in mk.plain:
                wrong.append(f"{c}: the Makefile sets {name} itself and ignores the "
                             f"environment's: say `make ... {name}=...`")
            elif name not in mk.reads and not named_in_the_code(name):
                wrong.append(f"{c}: nothing reads {name}")
    assert not wrong, "\n".join(wrong)


def test_elastic_mnist_commands_and_flags_are_the_clis():
    wrong = []
    for c in of("elastic-mnist"):
        if len(c.argv) < 2 or c.argv[1].startswith("-") or c.argv[1].endswith(":"):
            continue  # the program alone, or a line it printed (``elastic-mnist train: error``)
        parser = cli().get(c.argv[1])
        if parser is None:
            wrong.append(f"{c}: no command {c.argv[1]!r}")
            continue
        wrong += [f"{c}: `{c.argv[1]}` has no {f}" for f in flags(c.argv[2:])
                  if f not in options(parser)]
    assert not wrong, "\n".join(wrong)


def torchrun_parts(argv: list[str]) -> tuple[list[str], list[str] | None]:
    """torchrun's own words, and the job's (``elastic-mnist CMD ...``) if it launches ours."""
    for i, word in enumerate(argv):
        if word == "-m" and i + 1 < len(argv):
            job = ["elastic-mnist", *argv[i + 2:]] if argv[i + 1] == "elastic_mnist" else None
            return argv[1:i], job
    return argv[1:], None


def test_torchrun_lines_use_torchruns_flags_and_ours():
    wrong = []
    for c in of("torchrun"):
        own, job = torchrun_parts(c.argv)
        wrong += [f"{c}: torchrun has no {f}" for f in flags(own) if f not in torchrun_options()]
        if job and len(job) > 1:
            parser = cli().get(job[1])
            if parser is None:
                wrong.append(f"{c}: no command {job[1]!r}")
                continue
            wrong += [f"{c}: `{job[1]}` has no {f}" for f in flags(job[2:])
                      if f not in options(parser)]
    assert not wrong, "\n".join(wrong)


def test_every_torchrun_launch_that_needs_the_variable_sets_it():
    """torch's c10d rendezvous (``--standalone``, ``--rdzv_backend=c10d``) shares its store with
    the workers unless TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (docs/launching.md says why): each
    launch line of ours under it sets the variable; ours (``--rdzv_backend=elastic-mnist``) does
    not read it, and its lines do not set it."""
    wrong = []
    for c in of("torchrun"):
        own, job = torchrun_parts(c.argv)
        if job is None:
            continue  # a mention of torchrun's flags, not a launch of ours
        backend = next((w.split("=", 1)[1] for w in own if w.startswith("--rdzv_backend=")),
                       "c10d" if "--standalone" in own else None)
        if backend == "c10d" and c.env.get(SHARE_VAR) != "1":
            wrong.append(f"{c}: torch's c10d rendezvous without {SHARE_VAR}=1")
        if backend == "elastic-mnist" and SHARE_VAR in c.env:
            wrong.append(f"{c}: our rendezvous does not read {SHARE_VAR}")
    assert not wrong, "\n".join(wrong)


def test_the_variable_is_explained_once():
    """Every page but the one that explains TORCH_DISABLE_SHARE_RDZV_TCP_STORE links to that
    explanation wherever its prose speaks of the variable."""
    assert SHARE_ANCHOR.split("#")[1] in anchors(REPO / "docs" / "launching.md")
    wrong = []
    for page in PAGES:
        if page.name == "launching.md":
            continue
        for paragraph in prose_paragraphs(page):
            if SHARE_VAR in paragraph and SHARE_ANCHOR not in paragraph:
                wrong.append(f"{page_name(page)}: {paragraph[:100]}...")
    assert not wrong, "\n".join(wrong)


def prose_paragraphs(page: Path) -> list[str]:
    """A page's paragraphs outside code blocks and marked (generated) blocks."""
    text = re.sub(r"<!-- (\S+):begin -->.*?<!-- \1:end -->", "", page.read_text(), flags=re.DOTALL)
    paragraphs = re.split(r"\n\s*\n", text)
    return [p for p in paragraphs if not all(line.startswith("    ") for line in p.splitlines())]


def test_c10d_names_torchs_rendezvous_only():
    """"c10d" is torch's c10d rendezvous (``--rdzv_backend=c10d``); the store at which its
    agents meet, and ours, is the rendezvous store, never a "c10d store"."""
    wrong = [f"{page_name(page)}: ...{m.group(0)}..." for page in PAGES
             for m in re.finditer(r"(same c10d|c10d`? (TCPStore|store))", page.read_text())]
    assert not wrong, "\n".join(wrong)


def test_script_lines_use_the_scripts_flags():
    wrong = []
    for c in all_commands():
        script = re.fullmatch(r"scripts/(\w+)\.(py|sh)", c.argv[0])
        if not script:
            continue
        name, kind = script.groups()
        if not (REPO / c.argv[0]).exists():
            wrong.append(f"{c}: no {c.argv[0]}")
            continue
        if kind == "sh" and name != "gpu_check":
            continue  # a shell helper that takes a command, or nothing
        known = script_options(f"{name}.py") | (script_options("bench.py") if kind == "sh"
                                                 else set())
        wrong += [f"{c}: {c.argv[0]} has no {f}" for f in flags(c.argv[1:]) if f not in known]
    assert not wrong, "\n".join(wrong)


def test_job_script_lines_use_their_variables_and_train_flags():
    """``jobs/node.sh``, ``jobs/local.sh`` and ``sbatch jobs/slurm.sbatch`` lines: the variables
    set before them are read by the script, and their arguments are train flags."""
    train, wrong = options(cli()["train"]), []
    for c in all_commands():
        argv = c.argv
        if argv[0] == "sbatch":
            spec = next((i for i, w in enumerate(argv) if w.startswith("jobs/")), None)
            if spec is None:
                continue
            argv = argv[spec:]
        if not re.fullmatch(r"jobs/\w+\.(sh|sbatch)", argv[0]):
            continue
        script = (REPO / argv[0]).read_text()
        read_too = (REPO / "jobs" / "node.sh").read_text() if argv[0].endswith("sbatch") else ""
        wrong += [f"{c}: {argv[0]} reads no {name}" for name in c.env
                  if name not in script and name not in read_too]
        wrong += [f"{c}: train has no {f}" for f in flags(argv[1:]) if f not in train]
    assert not wrong, "\n".join(wrong)


def test_the_tests_the_docs_name_exist():
    wrong = []
    for page in PAGES:
        for match in re.finditer(r"tests/(test_\w+\.py)(?:::(\w+))?", page.read_text()):
            path = REPO / "tests" / match.group(1)
            named = match.group(2)
            if not path.exists() or (named and f"def {named}(" not in path.read_text()):
                wrong.append(f"{page_name(page)}: no {match.group(0)}")
    assert not wrong, "\n".join(wrong)


def section(page: Path, heading: str) -> str:
    """The text under ``heading`` (a line of the page) up to the next heading of its level."""
    text = page.read_text()
    level = heading.split(" ")[0]
    start = text.index(f"\n{heading}\n")
    end = re.search(rf"\n{level} ", text[start + len(heading) + 2:])
    return text[start:start + len(heading) + 2 + end.start()] if end else text[start:]


LAUNCHING = REPO / "docs" / "launching.md"
README = REPO / "README.md"


def test_the_command_table_lists_every_command_and_its_flags():
    table = section(LAUNCHING, "## Commands and flags")
    rows = re.findall(r"^\| `([a-z]+)([^`]*)` \|", table, re.MULTILINE)
    documented = {name for name, _ in rows}
    assert documented == set(cli()), f"documented {sorted(documented)}, the CLI {sorted(cli())}"
    wrong = [f"`{name}` has no {f}" for name, rest in rows for f in flags(rest.split())
             if f not in options(cli()[name])]
    assert not wrong, "\n".join(wrong)


def train_flags_section() -> str:
    return section(LAUNCHING, "### `train`'s flags")


def test_every_train_flag_is_documented_and_every_documented_one_exists():
    train = cli()["train"]
    own = {f for f in options(train) if not f.startswith("--no-")} - {"-h", "--help"}
    listed = {f for f in re.findall(r"`(--[a-z][\w-]*)", train_flags_section())
              if not f.startswith("--no-") and "_" not in f}  # torchrun's have underscores
    assert listed == own, (f"documented but not a flag: {sorted(listed - own)}; "
                           f"a flag not documented: {sorted(own - listed)}")


def test_the_train_flags_defaults_are_the_parsers():
    """``--flag`` (VALUE...) in the list: VALUE, where it is a number, a choice, or on/off, is
    the parser's default."""
    defaults = {s: a for a in cli()["train"]._actions for s in a.option_strings}
    wrong, checked = [], 0
    for flag, said in re.findall(r"`(--[\w-]+)[^`]*`\s*\(([^)]*)\)", train_flags_section()):
        action = defaults.get(flag)
        first = re.split(r"[\s,;:]", said.strip(), maxsplit=1)[0]
        if action is None or not first:
            continue
        try:
            number = float(first)
        except ValueError:
            number = None
        if number is not None and not isinstance(action.default, str):
            checked += 1
            if number != float(action.default):
                wrong.append(f"{flag}: the docs say {first}, the default is {action.default}")
        elif (action.choices and first in action.choices) or (
                isinstance(action.default, bool) and first in ("on", "off")):
            checked += 1
            if first not in (action.default, {True: "on", False: "off"}.get(action.default)):
                wrong.append(f"{flag}: the docs say {first}, the default is {action.default}")
    assert not wrong, "\n".join(wrong)
    assert checked >= 10


def test_make_help_names_every_target_in_one_line():
    done = subprocess.run(["make", "--no-print-directory", "-s", "help"], cwd=REPO, check=False,
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    listed = [line.split()[0] for line in done.stdout.splitlines() if line.startswith("  ")]
    mk = makefile()
    assert sorted(listed) == sorted(set(listed)), "a target listed twice"
    assert set(listed) == mk.phony, (f"not in make help: {sorted(mk.phony - set(listed))}; "
                                     f"not a target: {sorted(set(listed) - mk.phony)}")
    assert mk.phony <= mk.targets


def block(name: str) -> str:
    begin, end = markers.markers(name)
    text = markers.holder(name).read_text()
    return text.split(begin, 1)[1].split(end, 1)[0].strip("\n")


def test_the_recovery_tables_are_bench_recovery_json_rendered():
    import recovery

    results = json.loads((REPO / "bench" / "recovery.json").read_text())
    summary, detail = recovery.blocks(results)
    assert block("recovery") == summary, "scripts/recovery.py --update-readme"
    assert block("recovery-detail") == detail, "scripts/recovery.py --update-readme"


def test_the_readmes_first_screen_quotes_the_recovery_table():
    """The seconds the README's opening gives for a lost node are the table's medians."""
    import recovery

    results = json.loads((REPO / "bench" / "recovery.json").read_text())
    said = re.search(r"costs the other nodes ([\d.]+) to ([\d.]+) s in their own processes, "
                     r"against ([\d.]+) to ([\d.]+) s", " ".join(README.read_text().split()))
    assert said, "the README's opening lost its figures"
    assert said.groups() == recovery.node_loss_span(results)


def test_the_performance_table_is_bench_results_json_rendered():
    import bench

    results = json.loads((REPO / "bench" / "results.json").read_text())
    assert block("bench") == bench.readme_section(results).strip("\n"), \
        "scripts/bench.py --update-readme"


@pytest.mark.parametrize("page", PAGES, ids=page_name)
def test_links_between_pages_lead_somewhere(page):
    """Each relative link names a file that exists, and an anchor a heading of it."""
    wrong = []
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            wrong.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            wrong.append(f"{target}: no such heading")
    assert not wrong, "\n".join(wrong)


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings (and explicit ``id``s)."""
    found = set(re.findall(r'id="([^"]+)"', page.read_text()))
    for heading in re.findall(r"^#+ (.+)$", page.read_text(), re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        found.add(slug)
    return found
