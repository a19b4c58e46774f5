"""`kvcm-sidecar --help` and each subcommand's help speak to users, and every subcommand is
documented in README.md and docs/operations.md."""

from __future__ import annotations

import argparse

from sidecar.cli import build_parser
from sidecar.testbed.proc import ROOT


def subcommands() -> dict[str, argparse.ArgumentParser]:
    p = build_parser()
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_cli_help_top_line_says_what_the_tool_does() -> None:
    text = build_parser().format_help()
    first = text.split("\n\n")[1]
    assert first.startswith("Tell a KV Cache Manager")
    assert "reads the environment" not in text  # the module docstring is for developers


def test_cli_help_every_subcommand_has_a_description_and_helped_options() -> None:
    cmds = subcommands()
    assert {"run", "check-config", "status", "demo", "kvcm-server", "replay"} <= set(cmds)
    for name, p in cmds.items():
        assert p.description and len(p.description) > 60, name
        for action in p._actions:
            if action.option_strings and action.dest != "help":
                assert action.help, f"{name} {action.option_strings} has no help"


def test_cli_help_every_subcommand_is_documented() -> None:
    readme = (ROOT / "README.md").read_text()
    ops = (ROOT / "docs" / "operations.md").read_text()
    for name in subcommands():
        assert f"`{name}`" in readme, name
        assert f"`kvcm-sidecar {name}" in ops, name
