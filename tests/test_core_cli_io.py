"""The command-line shell (tensoralg.cli) and atomic file writes (tensoralg.io)."""

from __future__ import annotations

import contextlib
import os
import stat

import pytest

from tensoralg import cli, io


def test_no_arguments_prints_help(capsys):
    assert cli.main([]) == 2
    err = capsys.readouterr().err
    assert "usage: tensoralg" in err and "demo" in err


def test_errors_and_interrupts_are_one_line(monkeypatch, capsys, tmp_path):
    assert cli.main(["compare", str(tmp_path / "missing"), str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tensoralg compare: error:") and "\n" not in err

    def interrupted(args):
        raise KeyboardInterrupt

    parser = cli.build_parser()
    args = parser.parse_args(["compare", "x", "y"])
    monkeypatch.setattr(cli, "build_parser", lambda: _Fixed(parser, args, interrupted))
    assert cli.main(["compare", "x", "y"]) == 130
    assert capsys.readouterr().err.strip() == "tensoralg compare: interrupted"


class _Fixed:
    def __init__(self, parser, args, func):
        self.parser, self.args = parser, args
        args.func = func

    def parse_args(self, argv):
        return self.args

    def parse_known_args(self, argv):
        return self.args, []

    def print_help(self, fh):
        self.parser.print_help(fh)


def test_atomic_write_mode_and_folder_target(tmp_path):
    p = io.atomic_write_text(tmp_path / "a" / "b.txt", "hello")
    assert p.read_text() == "hello"
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(p.stat().st_mode) == 0o666 & ~umask
    with pytest.raises(IsADirectoryError, match="is a folder"):
        io.atomic_write_json(tmp_path / "a", {"x": 1})
    assert sorted(x.name for x in (tmp_path / "a").iterdir()) == ["b.txt"]  # no temp file left


def test_atomic_write_leaves_no_temp_file_on_failure(tmp_path):
    with pytest.raises(TypeError):
        io.atomic_write_bytes(tmp_path / "x.bin", "not bytes")  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []


def test_sigterm_unwinds_like_an_interrupt(tmp_path):
    """A SIGTERM'd command prints one line and exits 130 (so staged outputs are cleaned up)."""
    import signal
    import subprocess
    import sys

    code = ("import sys, time\n"
            "from tensoralg import cli\n"
            "def slow(args):\n"
            "    print('ready', flush=True); time.sleep(30)\n"
            "parser = cli.build_parser()\n"
            "args = parser.parse_args(['compare', 'x', 'y'])\n"
            "args.func = slow\n"
            "class P:\n"
            "    def parse_args(self, argv): return args\n"
            "    def parse_known_args(self, argv): return args, []\n"
            "cli.build_parser = lambda: P()\n"
            "sys.exit(cli.main(['compare', 'x', 'y']))\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGTERM)
    _out, err = proc.communicate(timeout=20)
    assert proc.returncode == 130
    assert err.strip() == "tensoralg compare: interrupted"


def test_main_puts_the_sigterm_handler_back(tmp_path, capsys):
    """cli.main installs a SIGTERM handler that raises KeyboardInterrupt (so a killed command
    cleans up); it was left installed after main returned, so a process that called main (a
    test run) raised KeyboardInterrupt wherever a later SIGTERM landed."""
    import signal

    before = signal.getsignal(signal.SIGTERM)
    for argv in (["compare", str(tmp_path / "missing"), str(tmp_path / "missing")],   # exit 2
                 ["demo", "--help"]):                                               # argparse exit
        with contextlib.suppress(SystemExit):
            cli.main(argv)
        assert signal.getsignal(signal.SIGTERM) is before, argv
    capsys.readouterr()
