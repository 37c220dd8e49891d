"""docs/cli.md matches `gefen-ckpt --help`: every command, every option and every choice the help
shows is in the page's usage block and in the command's own section, and the usage block names no
option the command does not have."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import typer.main
from typer.testing import CliRunner

from gefen_cli.app import app

DOC = (Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text()
COMMANDS = sorted(typer.main.get_command(app).commands)


def _help(*args: str) -> str:
    result = CliRunner().invoke(app, [*args, "--help"], env={"COLUMNS": "200", "TERMINAL_WIDTH": "200"})
    assert result.exit_code == 0, result.output
    return result.output


def _options_panel(command: str) -> str:
    text = _help(command)
    assert "Options" in text, text
    return text.split("Options", 1)[1]


def _options(command: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", _options_panel(command))) - {"--help"}


def _choices(command: str) -> list[str]:
    return re.findall(r"<([a-z]+(?:\|[a-z]+)+)>", _options_panel(command))


def _usage_line(command: str) -> str:
    """The command's usage in the page's first code block: its line and the indented lines that
    continue it, with ``[SOURCE OPTIONS]`` spelled out from the block's ``SOURCE OPTIONS:`` line."""
    block = DOC.split("```\n", 2)[1]
    entries = re.findall(r"^(gefen-ckpt \w+.*(?:\n[ \t]+.*)*)", block, flags=re.M)
    mine = [e for e in entries if re.match(rf"gefen-ckpt {command}\b", e)]
    assert len(mine) == 1, f"docs/cli.md's usage block needs one entry for {command!r}"
    shared = re.search(r"^SOURCE OPTIONS:(.*)$", block, flags=re.M)
    return mine[0].replace("[SOURCE OPTIONS]", shared.group(1) if shared else "")


def _section(command: str) -> str:
    parts = re.split(r"^## ", DOC, flags=re.M)
    sections = [p for p in parts if p.startswith(f"`{command} ")]
    assert len(sections) == 1, f"docs/cli.md needs one '## `{command} ...`' section"
    return sections[0]


def test_the_help_lists_the_commands_the_docs_describe():
    assert COMMANDS == ["convert", "diff", "inspect", "reshard", "verify"]
    top = _help()
    for command in COMMANDS:
        assert command in top


@pytest.mark.parametrize("command", COMMANDS)
def test_usage_block_has_exactly_the_options_of_the_help(command):
    usage = _usage_line(command)
    assert set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", usage)) == _options(command), usage


@pytest.mark.parametrize("command", COMMANDS)
def test_every_choice_of_the_help_is_documented(command):
    usage, section = _usage_line(command), _section(command)
    for choice in _choices(command):
        assert choice in usage, choice  # the same set, spelled as the help spells it
        assert all(f"`{value}`" in section or f"--to {value}" in section for value in choice.split("|")), choice


@pytest.mark.parametrize("command", COMMANDS)
def test_every_option_is_described_in_its_section(command):
    section = _section(command)
    missing = [opt for opt in _options(command) if opt not in section and opt not in DOC.split("## Exit codes")[0]]
    assert not missing, f"{command}: options not described in docs/cli.md: {missing}"
