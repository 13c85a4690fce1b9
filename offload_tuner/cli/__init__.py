"""offload-tuner command line: argparse entry point over the use cases of offload_tuner/app (and, by name, the
runtime's own commands).

A thin layer, one module per command (inspect, plan, explain, runtime_cmds: run/synth/calibrate, tune, report,
serve, demo), each with its cmd_* function and its add_parser: the flags, made from the request's fields, parsed
into the use case's request; its outcome printed. common.py holds what several share.
Results go to stdout (tables, or JSON with --json); progress lines and diagnostics go through logging to stderr
(logs.py: -v adds debug lines, -q keeps only warnings and errors). Expected errors print one line and exit 2.
SIGTERM and SIGHUP (`timeout`, systemd, `docker stop`, a closed terminal) stop a command as Ctrl-C does: the
running engine's process group ended, a tune's resume line printed, exit 128 + the signal (130, 143, 129).
"""
from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading

from planner.errors import InputError
from tuner.interrupt import signal_of, stop_now
from . import demo, explain, inspect, logs, plan, report, runtime_cmds, serve, tune
from .demo import cmd_demo
from .explain import cmd_explain
from .inspect import cmd_inspect
from .plan import cmd_plan
from .report import cmd_report
from .runtime_cmds import cmd_calibrate, cmd_run, cmd_synth
from .serve import cmd_serve
from .tune import cmd_tune, tune_options

__all__ = ["build_parser", "cmd_calibrate", "cmd_demo", "cmd_explain", "cmd_inspect", "cmd_plan", "cmd_report",
           "cmd_run", "cmd_serve", "cmd_synth", "cmd_tune", "main", "tune_options"]

COMMANDS = (inspect, plan, explain, runtime_cmds, tune, report, serve, demo)   # the order --help lists them in


class _Parser(argparse.ArgumentParser):
    argv: tuple[str, ...] = ()       # what it was asked to parse (the command named in it: did_you_mean's scope)

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        self.argv = tuple(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def error(self, message: str):   # one line, exit 2 (argparse's default prints usage first)
        # the line already starts "offload-tuner: error:": name the command alone ("tune: ..."), not the program
        command = self.prog.removeprefix("offload-tuner").strip()
        message += did_you_mean(message, self, self.argv)
        raise InputError(f"{command}: {message}" if command else message)


def _option_strings(parser: argparse.ArgumentParser) -> set[str]:
    """Every option string of `parser` and of its commands' parsers (argparse keeps them in its actions)."""
    out: set[str] = set()
    for action in parser._actions:
        out.update(action.option_strings)
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out |= _option_strings(sub)
    return out


def _commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The command parsers of `parser` by name ({} for a command's own parser)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def did_you_mean(message: str, parser: argparse.ArgumentParser, argv: tuple[str, ...] = ()) -> str:
    """"; did you mean 'tune'?" for a mistyped command or choice; for an unknown option, the closest option of any
    command (difflib's ratio over 0.6): "; did you mean --objective?" where it is the command's own, "; --trials
    is an option of tune, not of plan" where it is another's; "" when none is close. `argv`: what was parsed (it
    names the command)."""
    import difflib
    import re
    if m := re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message):
        close = difflib.get_close_matches(m[1], re.findall(r"'([^']*)'", m[2]), n=1)
        return f"; did you mean {close[0]!r}?" if close else ""
    if m := re.search(r"unrecognized arguments: (.*)", message):
        commands = _commands(parser)
        command = next((a for a in argv if a in commands), None)
        own = _option_strings(commands[command] if command else parser)
        for word in (w.split("=")[0] for w in m[1].split() if w.startswith("-")):
            close = difflib.get_close_matches(word, sorted(_option_strings(parser)), n=1)
            owners = [c for c, p in commands.items() if close and close[0] in _option_strings(p)]
            if close and close[0] in own:
                return f"; did you mean {close[0]}?"
            if close and command and owners:
                return f"; {close[0]} is an option of {', '.join(owners)}, not of {command}"
            if close and command:          # -v, -q: the program's own, read before the command only
                return f"; {close[0]} goes before the command: offload-tuner {close[0]} {command} ..."
    return ""


def build_parser() -> argparse.ArgumentParser:
    from offload_tuner import __version__
    ap = _Parser(prog="offload-tuner",
                 description="Find the fastest GPU+RAM placement for MoE GGUF models in llama.cpp")
    ap.add_argument("--version", action="version", version=f"offload-tuner {__version__}")
    loud = ap.add_mutually_exclusive_group()
    loud.add_argument("-v", "--verbose", dest="log_verbose", action="store_true",
                      help="debug lines too, on stderr (give it before the command)")
    loud.add_argument("-q", "--quiet", dest="log_quiet", action="store_true",
                      help="no progress lines or bars: only warnings and errors on stderr (before the command)")
    sub = ap.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for command in COMMANDS:
        command.add_parser(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    old: dict[int, object] = {}
    if threading.current_thread() is threading.main_thread():
        # Ctrl-C / SIGINT is how a tune is stopped and kept resumable (the service's stop sends it); a process
        # started in the background by a non-interactive shell inherits SIGINT ignored, which would turn a stop
        # into a study that runs to its end
        signal.signal(signal.SIGINT, signal.default_int_handler)
        # SIGTERM and SIGHUP end a run as Ctrl-C does (else Python dies at once: no resume line, and the engine's
        # process group is left to the kernel); SIGHUP ignored (nohup) stays ignored. Put back when main returns
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) is not signal.SIG_IGN:
                old[sig] = signal.signal(sig, stop_now)
    try:
        return _main(argv)
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def _main(argv: list[str]) -> int:
    try:
        # everything after the first "--" belongs to llama.cpp (explain), never to our own parser
        cut = argv.index("--") if "--" in argv else len(argv)
        args = build_parser().parse_args(argv[:cut])
        args.llama_args = argv[cut + 1:]
        # progress lines and diagnostics from the modules (a fast path dropped for its fallback, ...) on stderr
        logs.configure(logs.level(args.log_verbose, args.log_quiet))
        return args.func(args) or 0
    except InputError as e:
        hint = ("; llama.cpp's arguments go after --: explain MODEL --gpu 8GiB -- -ngl 99 ..."
                if argv[:1] == ["explain"] and "--" not in argv and "unrecognized arguments" in str(e) else "")
        print(f"offload-tuner: error: {e}{hint}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return 0
    except KeyboardInterrupt as e:          # Ctrl-C, SIGTERM, SIGHUP: 128 + the signal
        with contextlib.suppress(OSError):     # SIGHUP: the terminal may be gone
            print("offload-tuner: interrupted", file=sys.stderr)
        return 128 + signal_of(e)
