"""The user docs (README.md and docs/*.md) cannot drift from the code: their links resolve, every
page is reachable from the README, and every command they show is checked or marked as an
illustration.

The convention for code in the docs:

- Every fenced block has an info string: `sh`, `text`, `console` or `python`.
- A `sh` block holds commands this test checks, one a line (a trailing `\\` continues a line;
  blank lines and `#` comments are skipped; `&&` chains several). Each must be one of:
  - `python -m mixloop.train|diagnose|benchmark --config=PATH[:VARIANT] ...`: the config file
    exists, it and its `--config.KEY=VALUE` overrides parse as the commands parse them
    (ml_collections' config_flags, which mixloop/cli.py uses) and pass `mixloop.config.validate`,
    and every other flag is one the command defines. Nothing is trained: the check is cheap.
  - `pip install [-e] .` or `pip install -e '.[EXTRA,...]'` whose extras exist in setup.cfg;
  - `python3 -m venv DIR`, `. DIR/bin/activate`, and `pytest` (which .ci/run runs: CI is its test).
  `VAR=value` before a command (such as `TF_CONFIG=...`) is allowed.
- A `text` or `console` block is an illustration or a program's output: a command there, or one with
  placeholders (`EXPERIMENT`, `[--flag]`), is not checked. So is a command quoted in prose.
- A `python` block is code, not a command: the research recipes are run by test_recipes.py, the
  README's read-scalars snippet by test_trainer.py.

Links: every relative link `[text](target)` (and image) outside code resolves to a file, and a
`#anchor` (within the page or on another page) to one of its headings, slugged as GitHub does.
"""

from __future__ import annotations

import cli_runs
import collections
import configparser
import glob
import os
import re
import shlex
import sys

import pytest
from absl import flags
from ml_collections import config_flags

from mixloop.cli import fit_warmup
from mixloop.config import validate

ROOT = cli_runs.REPO
README = "README.md"
INFO_STRINGS = {"sh", "text", "console", "python"}
TOOLS = ("train", "diagnose", "benchmark")

_FENCE = re.compile(r"^\s*```")
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_INLINE_CODE = re.compile(r"`[^`\n]*`")


def pages() -> dict[str, str]:
    """{path relative to the repository: text} of README.md and docs/*.md."""
    paths = [README] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
    return {path: open(os.path.join(ROOT, path), encoding="utf-8").read() for path in paths}


def fenced_blocks(text: str) -> list[tuple[str, str, int]]:
    """[(info string, code, line of the opening fence)] of the page's fenced blocks."""
    blocks, opened, code = [], None, []
    for number, line in enumerate(text.split("\n"), 1):
        if _FENCE.match(line):
            if opened is None:
                opened, code = (line.strip()[3:].strip(), number), []
            else:
                blocks.append((opened[0], "\n".join(code), opened[1]))
                opened = None
        elif opened is not None:
            code.append(line)
    return blocks


def prose(text: str) -> str:
    """The page without its fenced blocks and inline code (links there are not links)."""
    lines, inside = [], False
    for line in text.split("\n"):
        if _FENCE.match(line):
            inside = not inside
            lines.append("")
        else:
            lines.append("" if inside else _INLINE_CODE.sub("", line))
    return "\n".join(lines)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors of the page's headings (a repeated heading gets -1, -2, ... as on GitHub)."""
    seen: collections.Counter = collections.Counter()
    found = set()
    for line in prose_with_code(text).split("\n"):
        match = re.match(r"^#{1,6} (.*)$", line)
        if match:
            base = slug(match[1])
            found.add(f"{base}-{seen[base]}" if seen[base] else base)
            seen[base] += 1
    return found


def prose_with_code(text: str) -> str:
    """The page without its fenced blocks (a `# comment` in a code block is no heading)."""
    lines, inside = [], False
    for line in text.split("\n"):
        if _FENCE.match(line):
            inside = not inside
        lines.append("" if inside or _FENCE.match(line) else line)
    return "\n".join(lines)


def links(text: str) -> list[str]:
    """The relative link targets in the page's prose (web and mail links left out)."""
    return [target for target in _LINK.findall(prose(text))
            if not re.match(r"^[a-z]+:", target)]


def broken_links(page: str, text: str) -> list[str]:
    """The links of `page` (a path relative to the repository) that name no file, or no heading."""
    broken = []
    for target in links(text):
        path, _, anchor = target.partition("#")
        resolved = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
        full = os.path.join(ROOT, resolved)
        if resolved != page and not os.path.exists(full):
            broken.append(f"{page}: {target}: no file {resolved}")
        elif anchor and resolved.endswith(".md"):
            linked = text if resolved == page else open(full, encoding="utf-8").read()
            if anchor not in anchors(linked):
                broken.append(f"{page}: {target}: no heading #{anchor} in {resolved}")
    return broken


def unreachable(texts: dict[str, str], start: str = README) -> set[str]:
    """The pages of `texts` that no chain of links from `start` reaches."""
    reached, todo = {start}, [start]
    while todo:
        page = todo.pop()
        for target in links(texts[page]):
            path = target.partition("#")[0]
            if path:
                linked = os.path.normpath(os.path.join(os.path.dirname(page), path))
                if linked in texts and linked not in reached:
                    reached.add(linked)
                    todo.append(linked)
    return set(texts) - reached


def extras() -> set[str]:
    parser = configparser.ConfigParser()
    parser.read(os.path.join(ROOT, "setup.cfg"))
    return set(parser["options.extras_require"])


def tool_flags(tool: str) -> set[str]:
    """The flags `python -m mixloop.TOOL` defines: --config and --workdir (mixloop/cli.py), and the
    tool's own (mixloop/tools/TOOL.py)."""
    names = {"config", "workdir"}
    source = os.path.join(ROOT, "mixloop", "tools", f"{tool}.py")
    if tool != "train":
        text = open(source, encoding="utf-8").read()
        names |= set(re.findall(r"DEFINE_\w+\(\s*\"(\w+)\"", text))
    return names


def parse_config(arguments: list[str]):
    """The config `--config=...` and its `--config.KEY=VALUE` overrides make, parsed by
    config_flags as the commands parse them (the config file's folder and the repository on the
    import path, as mixloop/cli.py puts them there)."""
    argv = ["command", *arguments]
    values = flags.FlagValues()
    # config_flags reads the overrides from the argv it is given (sys.argv by default).
    config_flags.DEFINE_config_file("config", None, "Experiment config file.", flag_values=values,
                                    sys_argv=argv)
    config_file = next(a for a in arguments if a.startswith("--config=")).split("=", 1)[1]
    folder = os.path.dirname(os.path.abspath(os.path.join(ROOT, config_file.split(":")[0])))
    saved_path, saved_cwd = list(sys.path), os.getcwd()
    sys.path[:0] = [ROOT, folder]
    os.chdir(ROOT)
    try:
        values(argv)
        return values.config
    finally:
        sys.path[:], _ = saved_path, os.chdir(saved_cwd)


def mixloop_command_errors(tool: str, arguments: list[str]) -> list[str]:
    """What is wrong with `python -m mixloop.TOOL ARGUMENTS` (nothing: [])."""
    if tool not in TOOLS:
        return [f"no command mixloop.{tool}"]
    configs = [a for a in arguments if a.startswith("--config=")]
    if len(configs) != 1:
        return ["names no --config=PATH (one)"]
    path = configs[0].split("=", 1)[1].split(":")[0]
    if not os.path.isfile(os.path.join(ROOT, path)):
        return [f"config file {path} does not exist"]
    errors = []
    for argument in arguments:
        name = argument.lstrip("-").split("=", 1)[0]
        if not argument.startswith("--") or (not name.startswith("config.") and
                                             name not in tool_flags(tool)):
            errors.append(f"mixloop.{tool} has no flag {argument}")
    config_arguments = [a for a in arguments if a.startswith("--config")]
    try:
        config = parse_config(config_arguments)
        fit_warmup(config)  # As the command does before validating.
        validate(config)
    except Exception as error:  # Any failure to parse or validate is the finding.
        errors.append(f"{type(error).__name__}: {' '.join(str(error).split())}")
    return errors


def command_errors(line: str) -> list[str]:
    """What is wrong with one logical line of an `sh` block (nothing: [])."""
    errors = []
    for piece in line.split("&&"):
        words = shlex.split(piece, comments=True)
        while words and re.match(r"^[A-Za-z_]\w*=", words[0]):  # VAR=value before a command.
            words.pop(0)
        if not words:
            continue
        if words[:3] == ["python", "-m", words[2] if len(words) > 2 else ""] and \
                words[2].startswith("mixloop."):
            errors += mixloop_command_errors(words[2].split(".", 1)[1], words[3:])
        elif words[:2] == ["pip", "install"]:
            targets = [w for w in words[2:] if w != "-e"]
            for target in targets:
                match = re.fullmatch(r"\.(?:\[([\w,-]+)\])?", target)
                if not match:
                    errors.append(f"pip install {target}: not this project")
                elif match[1]:
                    errors += [f"pip install {target}: no extra {extra!r} in setup.cfg"
                               for extra in match[1].split(",") if extra not in extras()]
        elif words[:3] == ["python3", "-m", "venv"] and len(words) == 4:
            pass
        elif words[0] in (".", "source") and len(words) == 2 and words[1].endswith("/bin/activate"):
            pass
        elif words == ["pytest"]:
            if "&& pytest" not in open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8").read():
                errors.append("pytest: .ci/run does not run it")
        else:
            errors.append(f"{piece.strip()!r} is not a command this test checks: put it in a "
                          "`text` block (an illustration)")
    return errors


def block_errors(text: str) -> list[str]:
    """What is wrong with the page's fenced blocks under the convention above (nothing: [])."""
    errors = []
    for info, code, number in fenced_blocks(text):
        if info not in INFO_STRINGS:
            errors.append(f"line {number}: a fenced block with info string {info!r}: use one of "
                          f"{sorted(INFO_STRINGS)}")
        elif info == "sh":
            for line in code.replace("\\\n", " ").split("\n"):
                errors += [f"line {number}: {line.strip()}: {error}" for error in command_errors(line)]
    return errors


def test_every_relative_link_resolves_to_a_file_and_heading():
    broken = [error for page, text in pages().items() for error in broken_links(page, text)]
    assert not broken, "\n".join(broken)


def test_every_docs_page_is_reachable_from_the_readme():
    found = pages()
    assert len(found) > 1
    assert not unreachable(found), f"not reachable from README.md: {sorted(unreachable(found))}"


@pytest.mark.parametrize("page", sorted(pages()))
def test_every_command_is_checked_or_marked_as_an_illustration(page):
    text = pages()[page]
    errors = block_errors(text)
    assert not errors, f"{page}:\n" + "\n".join(errors)


def test_the_readme_shows_the_ci_command_and_a_checked_run():
    commands = [code for info, code, _ in fenced_blocks(pages()[README]) if info == "sh"]
    assert any("pip install -e '.[test]' && pytest" in code for code in commands)
    assert any("python -m mixloop.train --config=" in code for code in commands)


# Each rule against a synthetic page, so that none of the tests above can pass by finding nothing.


def test_a_broken_link_or_anchor_is_found():
    page = "docs/synthetic.md"
    text = ("# Title\n\n[fine](recipes.md) [here](#title) [readme](../README.md#guides)\n"
            "[gone](missing.md) [no heading](recipes.md#no-such-heading) [self](#nowhere)\n"
            "`[in code](missing-too.md)`\n```text\n[in a block](missing-three.md)\n```\n")
    assert broken_links(page, text) == [
        "docs/synthetic.md: missing.md: no file docs/missing.md",
        "docs/synthetic.md: recipes.md#no-such-heading: no heading #no-such-heading in docs/recipes.md",
        "docs/synthetic.md: #nowhere: no heading #nowhere in docs/synthetic.md"]


def test_github_slugs():
    assert slug("Train metrics: `mixloop.Loss`") == "train-metrics-mixlooploss"
    assert slug("An objective updated every N steps (a WGAN's n_critic)") == \
        "an-objective-updated-every-n-steps-a-wgans-n_critic"
    assert anchors("# A\n## A\n```python\n# not a heading\n```\n") == {"a", "a-1"}


def test_an_unreachable_page_is_found():
    texts = {README: "[a](docs/a.md)", "docs/a.md": "[c](c.md#x)", "docs/b.md": "[a](a.md)",
             "docs/c.md": "", "docs/d.md": "`[d](d.md)`"}
    assert unreachable(texts) == {"docs/b.md", "docs/d.md"}


@pytest.mark.parametrize("line, error", [
    ("python -m mixloop.train --config=experiments/no_such.py", "does not exist"),
    ("python -m mixloop.train --config=experiments/charlm.py --config.train.no_such_key=1",
     "no_such_key"),
    ("python -m mixloop.train --config=experiments/charlm.py --config.train.num_steps=0",
     "num_steps"),
    ("python -m mixloop.benchmark --config=experiments/charlm.py --no_such_flag=1", "no flag"),
    ("python -m mixloop.fly --config=experiments/charlm.py", "no command"),
    ("pip install -e '.[no_such_extra]'", "no extra"),
    ("rm -rf runs", "not a command this test checks"),
])
def test_a_bad_sh_command_is_found(line, error):
    errors = block_errors(f"```sh\n{line}\n```\n")
    assert errors and error in errors[0], errors


def test_good_sh_commands_and_marked_illustrations_pass():
    text = ("```sh\npython3 -m venv .venv && . .venv/bin/activate && pip install -e '.[hub]'\n"
            "TF_CONFIG='{}' \\\n  python -m mixloop.diagnose --config=experiments/charlm.py "
            "--steps=2  # a comment\n```\n"
            "```text\npython -m mixloop.train --config=experiments/EXPERIMENT.py\n```\n")
    assert block_errors(text) == []
    assert block_errors("```\npython -m mixloop.train --config=x.py\n```\n") == [
        "line 1: a fenced block with info string '': use one of "
        "['console', 'python', 'sh', 'text']"]
