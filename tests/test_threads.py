"""--threads on every command and tensoralg.set_threads (torch and BLAS via threadpoolctl)."""

import argparse

import pytest
import torch
from threadpoolctl import threadpool_info

import tensoralg as ta
from tensoralg.cli import build_parser, main


def _leaves(parser, path=()):
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield path, parser
    for action in subs:
        for name, child in action.choices.items():
            yield from _leaves(child, path + (name,))


@pytest.fixture
def restore_threads():
    yield
    ta.set_threads(0)


def test_set_threads_applies_to_torch_and_blas(restore_threads):
    before = torch.get_num_threads()
    ta.set_threads(1)
    assert torch.get_num_threads() == 1
    pools = threadpool_info()
    assert pools and all(p["num_threads"] == 1 for p in pools), pools
    ta.set_threads(0)
    assert torch.get_num_threads() == before
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="threads"):
            ta.set_threads(bad)


def test_every_command_has_threads_with_a_stated_default():
    leaves = list(_leaves(build_parser()))
    assert len(leaves) >= 8
    for path, parser in leaves:
        opt = {a.dest: a for a in parser._actions}.get("threads")
        assert opt is not None, f"tensoralg {' '.join(path)} has no --threads"
        assert opt.default == 1 and "default 1" in opt.help, path


def test_cli_applies_threads_once_the_input_is_checked(restore_threads, tmp_path, capsys):
    # every command checks its paths and options first (answered without importing torch:
    # tests/test_cli.py), then applies --threads before any work
    ta.set_threads(1)
    rc = main(["sae", "stability", str(tmp_path / "a"), str(tmp_path / "b"), "--threads", "2"])
    assert rc == 2 and "RUN_A:" in capsys.readouterr().err
    assert torch.get_num_threads() == 1
    rc = main(["sae", "train", "--synthetic", "4,8,2,64", "--steps", "0", "--batch-size", "16",
               "--no-progress", "--out", str(tmp_path / "s"), "--threads", "2"])
    assert rc == 0 and torch.get_num_threads() == 2
    with pytest.raises(SystemExit):
        main(["matrix", "x", "--threads", "-1"])
    assert "expected an integer >= 0" in capsys.readouterr().err


def test_every_non_sae_option_states_its_default():
    """Help text states each default (issue 12 item 8); the quick/full step counts quoted in the
    help are the configuration classes' own."""
    for path, parser in _leaves(build_parser()):
        if path[0] == "sae":  # the SAE commands' help is maintained with the SAE code
            continue
        for action in parser._actions:
            if action.option_strings and action.dest != "help" and \
                    action.help != argparse.SUPPRESS:   # (an accepted, unlisted no-op)
                assert "default" in (action.help or ""), (path, action.option_strings)
    from tensoralg.audit.backdoor import BackdoorConfig
    from tensoralg.audit.forgetting import ForgettingConfig
    from tensoralg.audit.grokking import GrokkingConfig

    helps = {path: {a.dest: a.help for a in p._actions} for path, p in _leaves(build_parser())}
    for path, cls, fields in ((("audit", "backdoor"), BackdoorConfig, ("steps", "finetune_steps")),
                              (("audit", "forgetting"), ForgettingConfig, ("stage_steps",)),
                              (("audit", "grokking"), GrokkingConfig, ("P", "steps", "checkpoints"))):
        for f in fields:
            text = helps[path][f]
            assert f"default {getattr(cls(), f)};" in text, (path, f, text)
            assert f"{getattr(cls.quick(), f)} with --quick" in text, (path, f, text)


def test_threads_above_the_cpu_count_are_refused(restore_threads, capsys, tmp_path):
    """--threads 100000 crashed torch's thread pool (segmentation fault, exit 139, no message;
    found by a tester): above os.cpu_count() it is refused with the usage line, and by
    set_threads, before torch sees it."""
    import os

    too_many = (os.cpu_count() or 1) + 1
    with pytest.raises(SystemExit) as exc:
        main(["decompose", str(tmp_path / "ck"), "--threads", str(too_many)])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("usage: tensoralg decompose")
    assert err[-1].endswith(f"argument --threads: expected at most os.cpu_count() = "
                            f"{too_many - 1} threads (one per CPU core), got {too_many}")
    before = torch.get_num_threads()
    with pytest.raises(ValueError, match=r"^threads: expected at most os.cpu_count\(\)"):
        ta.set_threads(100_000)
    assert torch.get_num_threads() == before
