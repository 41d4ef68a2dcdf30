"""The ``qsfa`` command line.

Subcommands live in their own modules and are loaded on demand; each module provides
``register(subparsers)`` which adds its parser and sets ``func`` (``func(args) -> exit status``).

    qsfa backends                      which backends are usable here, and why not
    qsfa golden ...                    golden tensor sets (qsfa.golden.cli)
    qsfa conformance ...               hypothesis conformance runs (qsfa.conformance.cli)

Exit status: 0 success, 1 a check failed, 2 bad usage or bad input (one line on stderr, no traceback).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from ._errors import BackendError, InvalidArgument, InvalidDtype

#: subcommand -> module providing register(subparsers)
SUBCOMMAND_MODULES = {
    "golden": "qsfa.golden.cli",
    "conformance": "qsfa.conformance.cli",
}

#: what to install when a subcommand's optional dependency is missing
INSTALL_HINTS = {
    "hypothesis": "pip install 'qsfa[conformance]'",
    "torch": "pip install 'qsfa[torch]'",
    "matplotlib": "pip install 'qsfa[plot]'",
}


class UsageError(Exception):
    """Raised by subcommands for bad user input: printed as one line, exit status 2."""


# argparse ``type=`` functions shared by the subcommands: a bad value is one usage line (exit 2) naming the option
def seconds_arg(text: str) -> float:
    """A time budget: a finite number of seconds >= 0 (``nan`` / ``inf`` / ``-1`` refused)."""
    import math

    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"Invalid value, actual: {text!r}, reason: must be a number of seconds.") \
            from None
    if not math.isfinite(v) or v < 0:
        raise argparse.ArgumentTypeError(f"Invalid value, actual: {text!r}, reason: must be a finite number of "
                                         "seconds >= 0.")
    return v


def folder_arg(text: str) -> str:
    """An output folder: a non-empty path (an empty one would write into the current folder)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"Invalid value, actual: {text!r}, reason: must name a folder (an empty "
                                         "path would write into the current folder; pass '.' to mean it).")
    return text


def file_arg(text: str) -> str:
    """An input file: not a directory (a missing one is reported by the command that reads it)."""
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"Invalid value, actual: {text!r}, reason: is a directory; give a file.")
    return text


def _cmd_backends(args) -> int:
    from . import backends

    for name, st in backends().items():
        state = "usable" if st.usable else "unusable"
        why = f" ({st.reason})" if st.reason else ""
        print(f"{name:10s} {state}{why}")
        if st.usable and args.verbose:
            print(f"{'':10s} operators: {', '.join(st.operators) or '-'}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    # the first line of this module's docstring, without its reST markup (``qsfa`` -> qsfa)
    p = argparse.ArgumentParser(prog="qsfa", description=__doc__.split("\n\n")[0].replace("``", ""))
    p.add_argument("--version", action="version", version=f"qsfa {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    b = sub.add_parser("backends", help="list backends and whether they are usable here")
    b.add_argument("-v", "--verbose", action="store_true", help="also list each backend's operators")
    b.set_defaults(func=_cmd_backends)
    for name, mod in SUBCOMMAND_MODULES.items():
        try:
            module = importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name == mod:  # this build has no such subcommand
                continue
            if e.name is None or e.name.split(".")[0] == "qsfa":
                raise
            _register_unavailable(sub, name, e.name)  # an optional dependency is missing
            continue
        module.register(sub)
    _add_backend_module_option(p)
    return p


def _add_backend_module_option(parser):
    """``--backend-module MODULE`` (repeatable) on ``qsfa backends`` and on every subcommand with ``--backend``:
    import the module first, so a third-party backend it registers (qsfa.register_backend / register_impl) can be
    named. Backends a package declares in the ``qsfa.backends`` entry-point group need no option."""
    for action in parser._actions:  # argparse keeps subcommands as a _SubParsersAction
        if isinstance(action, argparse._SubParsersAction):
            for name, sp in action.choices.items():
                if "--backend" in sp._option_string_actions or name == "backends":
                    sp.add_argument("--backend-module", action="append", metavar="MODULE", default=None,
                                    help="import this module first (it registers a third-party backend); repeatable")
                _add_backend_module_option(sp)


def _import_backend_modules(modules):
    for m in modules or ():
        try:
            importlib.import_module(m)
        except Exception as e:  # noqa: BLE001 - any import failure is the user's module: say which and why
            raise UsageError(f"Invalid value for --backend-module, actual: {m!r}, reason: importing it failed: "
                             f"{type(e).__name__}: {str(e).rstrip('.')}.") from None


def _register_unavailable(sub, name: str, missing: str):
    """A subcommand whose optional dependency is not installed: it still parses, and says what to install."""
    top = missing.split(".")[0]
    hint = INSTALL_HINTS.get(top, f"pip install {top}")
    why = f"'qsfa {name}' needs the {top} package, which is not installed ({hint})"
    # no option prefix: every word after the subcommand (--help included) is taken as-is
    p = sub.add_parser(name, help=f"(unavailable: {top} is not installed)", add_help=False, prefix_chars="\0")
    p.add_argument("rest", nargs="*")

    def func(args):
        raise UsageError(why)

    p.set_defaults(func=func)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        _import_backend_modules(getattr(args, "backend_module", None))
        rc = int(args.func(args) or 0)
        sys.stdout.flush()  # a closed pipe shows here, inside the handler, not at interpreter exit
        return rc
    except BrokenPipeError:
        # `qsfa golden list smoke | head`: the reader left; stop quietly like other Unix tools. Point
        # stdout at devnull so the interpreter's final flush does not raise again.
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 141  # 128 + SIGPIPE, the status a shell reports for a writer killed by a closed pipe
    except (UsageError, InvalidArgument, InvalidDtype, BackendError, FileNotFoundError) as e:
        print(f"qsfa {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    # `python -m qsfa.cli`: run the imported module's main, so the UsageError the subcommands raise
    # (qsfa.cli.UsageError) is the class caught there, not this __main__ copy's
    from qsfa.cli import main as _main

    sys.exit(_main())
