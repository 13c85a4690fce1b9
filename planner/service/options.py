"""A JSON body whose keys are the CLI's option names -> the CLI's own parser -> the same Namespace `plan`,
`explain`, `inspect` or `tune` gets on the command line: one validation, one set of error messages.

Options that name a binary, a storage or an output folder are the server's, never a request's."""
from __future__ import annotations

import argparse
from typing import Any

from ..errors import InputError
from .security import PathPolicy

# never from a request: binaries and output/storage locations are the server's configuration; output format and
# progress bars are the service's business
DENIED = {"oracle", "llama-bench", "storage", "out", "no-report", "quiet", "json", "help", "spec"}
ALIASES = {"n-trials": "trials", "study-name": "study"}
LIST_JOIN = {"gpu", "kv-types"}          # the CLI takes a comma list; JSON may give a list
MAX_STRING = 4096
MAX_ARG = 4096


def subparser(command: str) -> argparse.ArgumentParser:
    from ..cli import build_parser
    ap = build_parser()       # a fresh parser per request: argparse objects are not shared across threads
    for action in ap._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[command]
    raise KeyError(command)


def _options(p: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    out = {}
    for a in p._actions:
        longs = [s for s in a.option_strings if s.startswith("--")]
        if longs:
            out[longs[0][2:]] = a
    return out


def _text(key: str, v: Any) -> str:
    if isinstance(v, bool) or v is None or isinstance(v, (dict, list)):
        raise InputError(f"{key}: expected a string or a number, got {type(v).__name__}")
    s = str(v)
    if len(s) > MAX_STRING or "\x00" in s:
        raise InputError(f"{key}: value too long or not text")
    return s


def allowed(command: str) -> list[str]:
    """The option names a request may use for COMMAND (documented in the OpenAPI schema too)."""
    names = ["model"] + [k for k in _options(subparser(command)) if k not in DENIED]
    return names + (["args"] if command == "explain" else [])


def to_namespace(command: str, body: Any, paths: PathPolicy) -> argparse.Namespace:
    """Parse BODY (a JSON object) as `offload-tuner COMMAND ... --json` would be parsed; the command line it
    stands for is kept as args.argv (a tune worker runs exactly that)."""
    if not isinstance(body, dict):
        raise InputError(f"{command}: the request body must be a JSON object of option names, e.g. "
                         '{"model": "preset:Qwen3-30B-A3B", "gpu": "16GiB"}')
    p = subparser(command)
    opts = _options(p)
    argv: list[str] = [command]
    body = {ALIASES.get(k.replace("_", "-"), k.replace("_", "-")): v for k, v in body.items()}
    if "model" not in body:
        raise InputError(f"{command}: give model (a preset:NAME[:QUANT] or a .gguf under the server's folders)")
    llama_args: list[str] = []
    for key, value in body.items():
        if key == "model":
            argv.append(paths.model(_text(key, value)))
        elif key == "args" and command == "explain":
            if not isinstance(value, list) or not all(isinstance(a, str) for a in value):
                raise InputError("args: a list of strings (the llama.cpp arguments, one per item; never a shell "
                                 "string)")
            if len(value) > MAX_ARG or any(len(a) > MAX_STRING for a in value):
                raise InputError(f"args: at most {MAX_ARG} arguments of {MAX_STRING} characters each")
            llama_args = list(value)
        elif key in DENIED or key not in opts:
            why = "is the server's configuration, not a request's" if key in DENIED else "is not an option"
            raise InputError(f"{command}: {key!r} {why}; options: {', '.join(allowed(command))}")
        else:
            action = opts[key]
            if action.nargs == 0:                  # store_true
                if not isinstance(value, bool):
                    raise InputError(f"{key}: expected true or false")
                if value:
                    argv.append(f"--{key}")
                continue
            if key in LIST_JOIN and isinstance(value, list):
                value = ",".join(_text(key, x) for x in value)
            text = _text(key, value)
            if key == "hardware":
                text = paths.hardware(text)
            if key == "build" and ("/" in text or text.startswith(".")):
                raise InputError("build: give DIALECT:N (e.g. ik:4840); a program path is the server's, not a "
                                 "request's")
            argv.append(f"--{key}={text}")        # '=' keeps a value that starts with '-' a value
    args = p.parse_args(argv[1:])
    args.argv = argv
    args.llama_args = llama_args
    args.json = True
    return args


def schema(command: str) -> dict[str, Any]:
    """A JSON schema of the body for the OpenAPI document: the CLI's options with their help text."""
    p = subparser(command)
    props: dict[str, Any] = {"model": {"type": "string", "description": "preset:NAME[:QUANT] or a .gguf under "
                                                                          "the server's --models folders"}}
    for key, a in _options(p).items():
        if key in DENIED:
            continue
        if a.nargs == 0:
            t: dict[str, Any] = {"type": "boolean"}
        elif a.type is int:
            t = {"type": "integer"}
        elif a.type is float:
            t = {"type": "number"}
        else:
            t = {"type": "string"}
        if a.choices:
            t["enum"] = list(a.choices)
        if a.help:
            t["description"] = a.help
        props[key] = t
    if command == "explain":
        props["args"] = {"type": "array", "items": {"type": "string"},
                         "description": "the llama.cpp arguments, one per item, e.g. [\"-ngl\", \"99\", \"-cmoe\"]"}
    return {"type": "object", "properties": props, "required": ["model"] + (["args"] if command == "explain" else []),
            "additionalProperties": False}
