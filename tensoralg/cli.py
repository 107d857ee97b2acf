"""The ``tensoralg`` command line.

One registry, `command_modules`: each package's command-line module adds its own
sub-commands with ``add_parsers(subparsers)``, and imports flow one way (this module imports
them, never the reverse), so that ``tensoralg --help`` stays fast (heavy imports happen inside
each command):

* ``demo``, ``audit``, ``compare``, ``matrix`` — `tensoralg.audit.cli`;
* ``sae`` — `tensoralg.sae.cli`;
* ``decompose`` — `tensoralg.decompose.cli`;
* ``import`` — `tensoralg.compile_cli` (a user's torch module through ``from_torch``).
"""

from __future__ import annotations

import argparse
import sys
import warnings

from ._version import __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tensoralg",
        description="Exact tensor similarity of multilinear networks, checkpoint audits and "
                    "identifiable sparse autoencoders.")
    parser.add_argument("--version", action="version", version=f"tensoralg {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for module in command_modules():
        module.add_parsers(sub)
    _name_leaves(parser)
    return parser


def command_modules() -> tuple:
    """The modules that register sub-commands, in the order of ``tensoralg --help``."""
    from . import compile_cli
    from .audit import cli as audit
    from .decompose import cli as decompose
    from .sae import cli as sae

    return (audit, sae, decompose, compile_cli)


def _name_leaves(parser: argparse.ArgumentParser) -> None:
    """Record each command's full name (e.g. ``tensoralg audit backdoor``) for error messages."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        parser.set_defaults(prog_name=parser.prog, leaf_parser=parser)
    for action in subs:
        for child in dict.fromkeys(action.choices.values()):
            _name_leaves(child)


def _terminate_as_interrupt():
    """SIGTERM (``timeout``, ``kill``) unwinds like Ctrl-C, so staged outputs are cleaned up.
    Returns the handler it replaced (None when not on the main thread: nothing installed), for
    `main` to put back: a program (or a test run) that calls ``main`` keeps its own
    SIGTERM behaviour afterwards, instead of a handler that raises KeyboardInterrupt wherever
    the signal lands (inside a gc callback it is only printed as an unraisable exception)."""
    import signal
    import threading

    def handler(signum, frame):
        raise KeyboardInterrupt

    if threading.current_thread() is threading.main_thread():
        return signal.signal(signal.SIGTERM, handler)
    return None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    if not (sys.argv[1:] if argv is None else argv):
        parser.print_help(sys.stderr)
        return 2
    args, extra = parser.parse_known_args(argv)
    if extra:   # reported with the command's own usage, not the top-level one
        getattr(args, "leaf_parser", parser).error(
            f"unrecognized arguments: {' '.join(extra)}")
    name = getattr(args, "prog_name", "tensoralg")
    previous_sigterm = _terminate_as_interrupt()
    # a warning reads "tensoralg compare: warning: ..." like the errors, not as a source line
    # of the console script that started the command
    formatwarning = warnings.formatwarning
    warnings.formatwarning = lambda message, *_a, **_k: f"{name}: warning: {message}\n"
    try:
        # every command has --threads; a command marked ``own_threads`` applies it itself after
        # checking its paths and options, so that bad input is answered before torch is imported
        if getattr(args, "threads", None) is not None and not getattr(args, "own_threads", False):
            from .threads import set_threads
            set_threads(args.threads)
        rc = args.func(args)
    except (ValueError, TypeError, OSError) as exc:
        # Bad input (including missing, misplaced or unwritable files): one line, no traceback.
        print(f"{name}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        return 130
    finally:
        warnings.formatwarning = formatwarning
        if previous_sigterm is not None:
            import signal

            signal.signal(signal.SIGTERM, previous_sigterm)
    return int(rc or 0)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
