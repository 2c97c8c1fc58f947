"""The ``controller`` command: one entry point, one subcommand per job.

Each subcommand lives in the module that owns the job and exposes
``register(subparsers)``; heavy imports (torch, SB3, gymnasium) happen inside the handlers, so
``controller --help`` stays fast and works in the hook's lean environment.

This module is the top of the layering (tests/test_layering.py): the one module that may reach
every layer, and it does so only by name (:data:`SUBCOMMAND_MODULES`), when the parser is built.

Only this module exits the process: library code raises :class:`ControllerError` (or
``OSError`` for files), which becomes one line on stderr and exit status 2. A
:class:`ControllerWarning` (the work went on with less than it was given, e.g. a trace with a
torn tail) becomes one line on stderr each time it is raised.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import warnings
from collections.abc import Callable
from typing import TextIO

from controller.errors import ControllerError, ControllerWarning

# Modules that add subcommands, in the order `--help` lists them.
SUBCOMMAND_MODULES = (
    "controller.service",  # serve
    "controller.traces",  # traces summarize
    "env.cli",  # fit, bench
    "agents.cli",  # train, eval
    "agents.demo",  # demo
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="controller",
        description=(
            "Learned speculation controller for SGLang: serve a policy that picks the EAGLE-3 "
            "draft depth at every decode step, record live traces, fit a simulator to them, "
            "train and evaluate PPO policies."
        ),
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            if exc.name and name.startswith(exc.name):
                continue  # that part is not built yet in this checkout
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    with warnings.catch_warnings():  # restores the warning filters and showwarning on return
        warnings.simplefilter("always", ControllerWarning)
        warnings.showwarning = _one_line_warnings(args.command, warnings.showwarning)
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except ControllerError as exc:
        print(f"controller {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        where = f" {exc.filename!r}" if getattr(exc, "filename", None) else ""
        print(f"controller {args.command}: error:{where} {exc.strerror or exc}", file=sys.stderr)
        return 2


def _one_line_warnings(command: str, show: Callable[..., None]) -> Callable[..., None]:
    """``warnings.showwarning`` that prints a :class:`ControllerWarning` as one line on stderr
    (other warnings go to ``show``, Python's own format)."""

    def show_warning(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: TextIO | None = None,
        line: str | None = None,
    ) -> None:
        if issubclass(category, ControllerWarning):
            print(f"controller {command}: warning: {message}", file=sys.stderr)
        else:
            show(message, category, filename, lineno, file, line)

    return show_warning


if __name__ == "__main__":
    sys.exit(main())
