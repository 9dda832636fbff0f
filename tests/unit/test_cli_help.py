"""`ctrflow <step> --help`: every option a user may leave out says what it defaults to."""

from __future__ import annotations

import argparse

import pytest

from ctrflow.cli import COMMANDS, Parser, build_parser, shows_default


def step_parsers() -> list[tuple[str, argparse.ArgumentParser]]:
    """(command words, parser) of every step and of every action under a step (pipeline run, ...)."""
    found = []
    for name in COMMANDS:
        parser = build_parser([name])
        pending = [(name, parser._subparsers._group_actions[0].choices[name])]
        while pending:
            words, current = pending.pop()
            found.append((words, current))
            for action in current._actions:
                if isinstance(action, argparse._SubParsersAction):
                    pending += [(f"{words} {sub}", p) for sub, p in action.choices.items()]
    return found


@pytest.mark.parametrize("words,parser", step_parsers(), ids=lambda v: v if isinstance(v, str) else "")
def test_every_help_entry_shows_its_default(words, parser):
    formatter = parser._get_formatter()
    missing = []
    for action in parser._actions:
        if not shows_default(action):
            continue
        entry = formatter._format_action(action)
        if "default" not in entry:
            missing.append(entry.strip())
    assert not missing, f"ctrflow {words} --help: entries without their default: {missing}"


def test_help_prints_the_default_of_an_option_that_had_no_help_text(capsys):
    parser = Parser(prog="ctrflow step")  # argparse itself prints nothing for an option without help
    parser.add_argument("--freq-threshold", type=int, default=6)
    with pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--freq-threshold FREQ_THRESHOLD (default: 6)" in out


def test_the_help_of_ctrflow_and_preprocess_speaks_of_any_described_table(capsys):
    for argv in (["--help"], ["preprocess", "--help"]):
        with pytest.raises(SystemExit):
            build_parser(argv).parse_args(argv)
        out = " ".join(capsys.readouterr().out.split())
        assert "raw Criteo TSV ->" not in out
        assert "CSV/TSV/Parquet table a --dataset file describes" in out
