"""`tensoralg sae` fixes: a new run never mixes with an earlier run's files in --out, the
resume-past---steps message names the run's real step, the shared options in docs/cli.md match
the parsers, NaN/inf errors name the first bad row, TrainConfig errors name the CLI flags."""

import argparse
import re
from pathlib import Path

import pytest

from tensoralg.cli import build_parser

def _leaves(parser, name=()):
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield " ".join(name), parser
    for action in subs:
        for child_name, child in action.choices.items():
            yield from _leaves(child, (*name, child_name))


def test_shared_options_in_the_docs_match_every_command():
    """docs/cli.md's table of --seed / --no-progress per command, against the real parsers;
    --threads and --json are stated for every command."""
    text = (Path(__file__).parents[1] / "docs" / "cli.md").read_text()
    section = text.split("## Options every command takes", 1)[1].split("\n## ", 1)[0]
    leaves = dict(_leaves(build_parser()))
    claimed = {}
    for row in re.findall(r"^\| (`.*?) \| (.*?) \| (.*?) \|$", section, re.M):
        for cmd in re.findall(r"`([^`]+)`", row[0]):
            names = [n for n in leaves if n.startswith(cmd[:-1])] if cmd.endswith("*") else [cmd]
            for n in names:
                claimed[n] = (row[1].startswith("yes"), row[2].startswith("yes"))
    assert set(claimed) == set(leaves), set(leaves) ^ set(claimed)
    for name, parser in leaves.items():
        opts = {o for a in parser._actions for o in a.option_strings}
        assert {"--threads", "--json"} <= opts, name
        assert ("--seed" in opts, "--no-progress" in opts) == claimed[name], name
    with pytest.raises(SystemExit):   # what the tester ran: refused, as the docs now say
        build_parser().parse_args(["sae", "activations", "--out", "a.npy", "--no-progress"])
