"""The docs site (mkdocs.yml, docs/) and README.md stay true to the code: light tests, no process but mkdocs.

* The generated pages (the configuration keys, the verl key table) equal what
  ``megarl.devtools.docs_pages`` writes from the code today.
* ``mkdocs build --strict`` passes: no broken link or anchor, no page missing from the nav, no
  warning. Skipped where mkdocs is not installed (``make test`` installs it: ``setup.py``, ``[test]``).
* README.md stays short (at most 250 lines), starts with the two set-up commands, and every
  relative link in it names a file (and a heading there) that exists: mkdocs does not build it.
* Every config snippet in the docs and in README.md still passes megarl's own config checks:

  - a ```` ```yaml ```` block whose top-level keys are all sections of the schema (or ``defaults``)
    is a megarl config. It is composed as a YAML file with ``megarl.checks.load_config`` and every
    config rule (not the pre-flight, which reads the model, the data and the GPU). A snippet without
    a ``defaults:`` list is checked on top of ``quickstart`` (``defaults: [quickstart, _self_]``), so
    it may show only the keys it is about; ``data.train_files`` and ``actor_rollout_ref.model.path``
    get stand-in paths unless it sets them. Other YAML (a tool config, ``tools:``) is not a config.
  - a command in a ```` ```bash ```` block that runs ``megarl train``, ``megarl config show``,
    ``python -m megarl.run.train`` or ``python -m megarl.trainer.main_ppo`` is split as the command
    line does (``parse_command_line``) and composed with its config and overrides: keys, types and
    refused features are checked; a command with a ``...`` placeholder shows the keys it is about,
    not a whole run, and gets no other config rule, while a command without one is a whole run and
    must pass every config rule too (batch arithmetic, device counts, memory fractions; not the
    pre-flight, which here would only report the models and data it names as missing).
    ``...`` and ``key=value`` are placeholders and dropped; ``key=~/path`` is expanded as bash
    does; a config that is not found (a YAML of the reader's own) is replaced by the default
    config, so its overrides are still checked. A launcher in a bash block is checked the same way
    with its config: ``bash launch/ray_local.sh CONFIG key=value`` and ``sbatch launch/<name>.sh
    key=value`` (the config its ``slurm/launch.sh`` line names; ``[key=value ...]`` is a placeholder
    too). ``megarl plan`` commands are not checked here.

  Either way the only problems allowed are files that do not exist here and required keys a
  command leaves to the reader; an unknown key, a wrong type or a refused feature fails the test.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from megarl.checks import ConfigError, load_config
from megarl.config import resolve_config_path
from megarl.config.command_line import parse_command_line
from megarl.config.compose import DEFAULT_CONFIG
from megarl.config.schema import MegaRLConfig
from megarl.devtools.docs_pages import COMMAND, REPO, generated_pages

DOCS = REPO / "docs"
README = REPO / "README.md"
PAGES = [README, *sorted(DOCS.rglob("*.md"))]
SECTIONS = set(MegaRLConfig.__dataclass_fields__)
STAND_INS = {"data.train_files": "/docs-snippet/train.parquet", "actor_rollout_ref.model.path": "/docs-snippet/model"}
ENTRY_POINTS = (("megarl", "train"), ("megarl", "config", "show"), ("-m", "megarl.run.train"),
                ("-m", "megarl.trainer.main_ppo"))
PLACEHOLDERS = {"...", "key=value", "[key=value", "...]"}
LAUNCHER = re.compile(r"(^|/)launch/(\w+)\.sh$")
ALLOWED = re.compile(r"not found|does not exist|no such (file|directory)|required config keys are not set")


def code_blocks(language: str) -> list[tuple[str, str]]:
    """(``docs/page.md:line``, text) of every fenced block in ``language`` in docs/ and README.md."""
    found = []
    for page in PAGES:
        lines = page.read_text(encoding="utf-8").splitlines()
        for start, line in enumerate(lines):
            if line.strip() == f"```{language}":
                end = next(i for i in range(start + 1, len(lines)) if lines[i].strip() == "```")
                found.append((f"{page.relative_to(REPO)}:{start + 1}", "\n".join(lines[start + 1:end])))
    return found


def config_snippets() -> list[tuple[str, str]]:
    snippets = []
    for where, text in code_blocks("yaml"):
        tree = yaml.safe_load(text)
        if isinstance(tree, dict) and set(tree) <= SECTIONS | {"defaults"} and set(tree) & SECTIONS:
            snippets.append((where, text))
    return snippets


def launcher_config(script: str) -> str:
    """The config a ``launch/`` script runs: ``slurm/launch.sh CONFIG`` in an sbatch script."""
    found = re.search(r'slurm/launch\.sh" (\w+)', (REPO / "launch" / f"{script}.sh").read_text(encoding="utf-8"))
    assert found, f"launch/{script}.sh names no config"
    return found.group(1)


def megarl_commands() -> list[tuple[str, list[str], bool]]:
    """(where, the arguments after the entry point, whether it is ``config show``); a launcher's are
    ``--config-name CONFIG`` and what follows it."""
    commands = []
    for where, line in shell_lines():
        words = shlex.split(line, comments=True)
        launcher = next((i for i, word in enumerate(words) if LAUNCHER.search(word)), None)
        if launcher is not None:
            script, rest = LAUNCHER.search(words[launcher]).group(2), words[launcher + 1:]
            if script == "ray_local":
                config, rest = rest[0], rest[1:]
            else:
                config = launcher_config(script)
            words = ["megarl", "train", "--config-name", config, *rest]
        names = ["megarl" if Path(word).name == "megarl" else word for word in words]  # .venv/bin/megarl
        for entry in ENTRY_POINTS:
            at = next((i for i in range(len(names)) if tuple(names[i:i + len(entry)]) == entry), None)
            if at is not None:
                args = [re.sub(r"^([^=]+=)~/", lambda m: m.group(1) + str(Path.home()) + "/", w)  # bash expands it
                        for w in words[at + len(entry):]]
                commands.append((where, args, "show" in entry))
    return commands


def shell_lines() -> list[tuple[str, str]]:
    """(``docs/page.md:line``, command) of every ```bash block's commands, continuation lines joined."""
    found = []
    for where, text in code_blocks("bash"):
        page, first = where.rsplit(":", 1)
        pending, start = "", 0
        for offset, line in enumerate(text.splitlines()):
            start = start if pending else offset
            pending += line[:-1] + " " if line.endswith("\\") else line
            if not line.endswith("\\"):
                found.append((f"{page}:{int(first) + 1 + start}", pending))
                pending = ""
    return found


def problems_of(*args, **kwargs) -> list[str]:
    """The problems ``load_config`` reports that are not a missing file or a key left to the reader."""
    try:
        load_config(*args, **kwargs)
    except ConfigError as exc:
        return [p.message for p in exc.problems if not ALLOWED.search(p.message)]
    return []


def refusals_of(*args, **kwargs) -> list[str]:
    """The features megarl refuses that a config asks for (the config rules' refusals included)."""
    try:
        load_config(*args, **kwargs)
    except ConfigError as exc:
        return [p.message for p in exc.refusals]
    return []


def test_generated_pages_are_up_to_date():
    for relative, text in generated_pages().items():
        committed = (REPO / relative).read_text(encoding="utf-8") if (REPO / relative).exists() else None
        assert committed == text, f"{relative} is out of date with the code: run `{COMMAND}` and commit it"


@pytest.mark.heavy  # mkdocs in a subprocess
def test_mkdocs_build_is_strict_clean(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs is not installed: make test installs it (setup.py, [test])")
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(REPO / "mkdocs.yml"),
                             "-d", str(tmp_path / "site")], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert result.returncode == 0, result.stdout + result.stderr


def slug(heading: str) -> str:
    """The anchor Python-Markdown's toc gives a heading (its default slugify, markup removed)."""
    text = re.sub(r"[^\w\s-]", "", heading.replace("`", "")).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def test_readme_is_short_and_starts_with_the_two_commands():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines: the details belong in docs/"
    assert lines[2] == "```bash" and lines[3].startswith("make quickstart") and lines[4].startswith("make test")


def test_readme_links_point_to_pages_that_exist():
    text = README.read_text(encoding="utf-8")
    links = [t for t in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"[a-z]+:", t)]
    assert len(links) >= 20
    for target in links:
        path, _, anchor = target.partition("#")
        page = REPO / path
        assert page.is_file(), f"README.md links to {target}: no such file"
        if anchor:
            headings = [slug(h) for h in re.findall(r"^#+ (.+)$", page.read_text(encoding="utf-8"), re.M)]
            assert anchor in headings, f"README.md links to {target}: no such heading in {path}"


def test_docs_have_snippets_to_check():
    assert config_snippets() and len(megarl_commands()) >= 5


@pytest.mark.parametrize("where,text", config_snippets(), ids=[w for w, _ in config_snippets()])
def test_yaml_config_snippet_validates(where, text, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tree = yaml.safe_load(text)
    if "defaults" not in tree:
        text = "defaults:\n  - quickstart\n  - _self_\n" + text
    path = tmp_path / "snippet.yaml"
    path.write_text(text)
    given = OmegaConf.create(tree)
    overrides = [f"{key}={value}" for key, value in STAND_INS.items() if OmegaConf.select(given, key) is None]
    assert problems_of(path, overrides) == [], f"{where}: this YAML no longer passes megarl's config checks"


@pytest.mark.parametrize("where,args,show", megarl_commands(), ids=[w for w, _, _ in megarl_commands()])
def test_command_line_snippet_composes(where, args, show, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    command = parse_command_line([a for a in args if a not in PLACEHOLDERS], leading_name=show)
    name, path = command.name, command.config_path
    try:
        resolve_config_path(name, path)
    except ConfigError:  # a YAML of the reader's own: check the overrides on the default config
        name, path = DEFAULT_CONFIG, None
    whole = not any(a in ("...", "...]") for a in args)
    problems = problems_of(name, command.overrides, validate=whole, config_path=path)
    problems += [p for p in refusals_of(name, command.overrides, config_path=path) if p not in problems]
    assert problems == [], f"{where}: `{shlex.join(args)}` no longer composes, or asks for a refused feature"
