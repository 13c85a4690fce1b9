"""A JSON body -> the use case's request dataclass (offload_tuner/app/requests.py), checked field by field with the
types the dataclass declares and worded as the CLI words the same mistake; and the OpenAPI schema of each body,
made from the same fields and their help.

Keys are the request's field names; the CLI's spelling (dashes: `n-prompt`, `kv-types`) and a few old names
(ALIASES) are taken too. Fields that name a binary, a storage or an output folder are the server's, never a
request's (DENIED); output format and progress bars are the service's business."""
from __future__ import annotations

from typing import Any

from ..app.fields import FLOAT_TEXT, INT_TEXT, Option, options
from ..app.requests import ExplainRequest, InspectRequest, PlanRequest, TuneRequest
from planner.errors import InputError
from planner.hardware import MAX_GPUS, preset_names as hardware_names
from .security import PathPolicy

REQUESTS: dict[str, type] = {"inspect": InspectRequest, "plan": PlanRequest, "explain": ExplainRequest,
                             "tune": TuneRequest}
# never from a request: binaries and output/storage locations are the server's configuration; output format and
# progress bars are the service's business
DENIED = {"oracle", "llama_bench", "llama_server", "storage", "out", "no_report", "quiet", "json", "help", "spec"}
ALIASES = {"n_trials": "trials", "study_name": "study", "timeout": "timeout_s"}
LIST_JOIN = {"gpu"}                       # a comma list on the command line; JSON may give a list
MAX_STRING = 4096
MAX_ARG = 512                             # llama.cpp arguments of one explain request
WORKLOAD_FILES = (".toml", ".jsonl", ".json")   # what planner.workload.load reads as a file
MODEL = "preset:NAME[:QUANT] or a .gguf under the server's --models folders"
EXAMPLE_MODEL = "preset:Qwen3-30B-A3B"
EXAMPLES: dict[str, dict[str, Any]] = {     # one good body per command, shown in the document (and sent by its fuzz)
    "inspect": {"model": EXAMPLE_MODEL},
    "plan": {"model": EXAMPLE_MODEL, "gpu": "16GiB", "ctx": 16384},
    "explain": {"model": EXAMPLE_MODEL, "gpu": "16GiB", "args": ["-ngl", "99", "-ot", "exps=CPU", "-c", "8192"]},
    "tune": {"model": EXAMPLE_MODEL, "engine": "sim", "hardware": "rtx4090-ddr5", "gpu": "16GiB", "trials": 2,
             "pool": 10, "study": "example"},
}


def _text(key: str, v: Any) -> str:
    if not isinstance(v, str):
        raise InputError(f"{key}: expected a string, got {_json_type(v)}")
    if len(v) > MAX_STRING or "\x00" in v:
        raise InputError(f"{key}: value too long or not text")
    return v


def _json_type(v: Any) -> str:
    return {bool: "true or false", type(None): "null", dict: "an object", list: "a list", str: "a string",
            int: "a number", float: "a number"}.get(type(v), type(v).__name__)


def _number(o: Option, key: str, v: Any) -> str:
    """An int or float field's value as the command line's text: a JSON number, or that text itself."""
    if isinstance(v, bool) or not isinstance(v, (int, float, str)) or (o.kind == "int" and isinstance(v, float)):
        raise InputError(f"{key}: expected {'an integer' if o.kind == 'int' else 'a number'} (or its text), got "
                         f"{_json_type(v)}")
    return _text(key, v) if isinstance(v, str) else repr(v)


def _fields(command: str) -> dict[str, Option]:
    """The fields a request for COMMAND may set: the dataclass's, less the server's and those with no JSON form."""
    return {n: o for n, o in options(REQUESTS[command]).items() if n not in DENIED and o.kind != "other"}


def allowed(command: str) -> list[str]:
    """The keys a request may use for COMMAND (the schema's properties)."""
    return list(_fields(command))


def _key(key: str) -> str:
    k = key.replace("-", "_")
    return ALIASES.get(k, k)


def _value(command: str, o: Option, key: str, value: Any, paths: PathPolicy) -> Any:
    if o.kind == "bool":
        if not isinstance(value, bool):
            raise InputError(f"{key}: expected true or false")
        return value
    if o.name == "args":                 # explain's llama.cpp arguments
        if not isinstance(value, list) or not all(isinstance(a, str) for a in value):
            raise InputError("args: a list of strings (the llama.cpp arguments, one per item; never a shell string)")
        if len(value) > MAX_ARG or any(len(a) > MAX_STRING for a in value):
            raise InputError(f"args: at most {MAX_ARG} arguments of {MAX_STRING} characters each")
        return tuple(value)
    if o.kind in ("int", "float"):
        value = _number(o, key, value)
    if (o.name in LIST_JOIN or o.kind == "list") and isinstance(value, list):
        value = ",".join(_text(key, x) for x in value)
    text = _text(key, value)
    if o.name == "model":
        return paths.model(text)
    if o.name == "hardware":
        return paths.hardware(text)
    if o.name == "build" and ("/" in text or text.startswith(".")):
        raise InputError("build: give DIALECT:N (e.g. ik:4840); a program path is the server's, not a request's")
    if o.name == "workload":            # a preset, or a file under the server's folders (never one elsewhere: it
        from planner.workload import PRESETS        # would be the server's, read on a client's word)
        if text in PRESETS:
            return text
        if not paths.roots or not text.endswith(WORKLOAD_FILES):
            raise InputError(f"workload: give one of {', '.join(PRESETS)} (a workload file is the server's, not a "
                             "request's, unless it is a " + " or ".join(WORKLOAD_FILES) + " under the server's "
                             "--models folders)")
        return paths.resolve(text, "workload")
    if o.name == "kv_types":
        from ..app.requests import parse_kv_types
        return parse_kv_types(text, "--kv-types")
    try:
        return o.parse(text)
    except InputError as e:               # as the CLI's parser says it
        raise InputError(f"{command}: argument {o.flag}: {e}") from None


def request(command: str, body: Any, paths: PathPolicy) -> Any:
    """BODY (a JSON object) as COMMAND's request: the same dataclass `offload-tuner COMMAND ...` builds from its
    flags, with the same defaults and the same messages for a bad value."""
    if not isinstance(body, dict):
        raise InputError(f"{command}: the request body must be a JSON object of option names, e.g. "
                         '{"model": "preset:Qwen3-30B-A3B", "gpu": "16GiB"}')
    if not any(_key(k) == "model" for k in body):
        raise InputError(f"{command}: give model (a preset:NAME[:QUANT] or a .gguf under the server's folders)")
    fields = _fields(command)
    values: dict[str, Any] = {}
    for key, value in body.items():
        name = _key(key)
        if name in DENIED or name not in fields:
            why = "is the server's configuration, not a request's" if name in DENIED else "is not an option"
            raise InputError(f"{command}: {key!r} {why}; options: {', '.join(allowed(command))}")
        values[name] = _value(command, fields[name], key, value, paths)
    cls = REQUESTS[command]
    return cls.from_values(values) if cls is TuneRequest else cls(**values)


# What the use cases refuse in one field alone, said in the schema (a generated body the schema allows is refused
# only for what one field cannot say: a plan that fits nowhere, a build of the other dialect, llama.cpp's own
# arguments). Sizes as hardware.parse_size reads them, counts as offload_tuner/app checks them (positive, nonneg).
SIZE = r"\s*[0-9]+(\.[0-9]+)?\s*([bB]|[kKmMgGtT]([iI]?[bB])?)?\s*"
BOUNDS: dict[str, dict[str, Any]] = {
    **{n: {"minimum": 1} for n in ("ctx", "ubatch", "batch", "threads", "top", "trials", "reps")},
    **{n: {"minimum": 0} for n in ("pool", "n_prompt", "n_gen", "depth", "confirm")},
    "margin": {"pattern": f"^({SIZE}|auto)$"},
    "ram": {"pattern": f"^{SIZE}$"},
    "build": {"pattern": "^(pinned|(mainline|ik)(:([0-9]+|pinned))?)$"},
    "ttft": {"pattern": r"^\s*[0-9]+(\.[0-9]+)?\s*(ms|s|m)?\s*$"},
    "study": {"pattern": r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$"},
}
GPU_LIST = f"^({SIZE})?(,({SIZE})?)*$"       # empty items are skipped, as on the command line


def _type(o: Option) -> dict[str, Any]:
    if o.kind == "bool":
        return {"type": "boolean"}
    if o.kind == "int":
        return {"oneOf": [{"type": "integer", **BOUNDS.get(o.name, {})},
                          {"type": "string", "pattern": f"^{INT_TEXT}$"}]}
    if o.kind == "float":
        return {"oneOf": [{"type": "number"}, {"type": "string", "pattern": f"^{FLOAT_TEXT}$"}]}
    if o.kind == "choice":
        return {"type": "string", "enum": list(o.choices)}
    if o.name == "args":
        return {"type": "array", "maxItems": MAX_ARG, "items": {"type": "string", "maxLength": MAX_STRING}}
    if o.name == "gpu":
        item = {"type": "string", "pattern": f"^{SIZE}$"}
        return {"oneOf": [{"type": "string", "pattern": GPU_LIST, "maxLength": MAX_STRING},
                          {"type": "array", "items": item, "minItems": 1, "maxItems": MAX_GPUS}]}
    if o.kind == "list":
        return {"oneOf": [{"type": "string", "maxLength": MAX_STRING},
                          {"type": "array", "items": {"type": "string", "maxLength": MAX_STRING}}]}
    if o.name == "hardware":         # a preset, or a profile under the server's folders (a path: '/' or .json)
        return {"anyOf": [{"type": "string", "enum": hardware_names()},
                          {"type": "string", "pattern": r"(/|\.json$)", "maxLength": MAX_STRING}]}
    if o.name == "workload":         # a preset, or a workload file under the server's folders
        from planner.workload import PRESETS
        return {"anyOf": [{"type": "string", "enum": list(PRESETS)},
                          {"type": "string", "pattern": r"\.(toml|jsonl|json)$", "maxLength": MAX_STRING}]}
    return {"type": "string", "maxLength": MAX_STRING, **BOUNDS.get(o.name, {})}


def schema(command: str, limits: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """A JSON schema of COMMAND's body for the OpenAPI document: the request's fields, typed, with their help;
    LIMITS: a server's own bounds on some fields (tune's trials, the engines it runs), merged in."""
    props: dict[str, Any] = {}
    for name, o in _fields(command).items():
        help_text = MODEL if name == "model" else o.help
        props[name] = {**_type(o), **(limits or {}).get(name, {}),
                       **({"description": help_text} if help_text else {})}
    props["model"] = {**props["model"], **_model_type()}
    required = [n for n, o in _fields(command).items() if o.required] + (["args"] if command == "explain" else [])
    machine = {"anyOf": [{"required": ["gpu"]}, {"required": ["hardware"]}]} if command in ("plan", "tune") else {}
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False, **machine}


def _model_type() -> dict[str, Any]:
    """A preset (as preset_models() spells them; load_preset also takes other cases) or a .gguf under the
    server's folders."""
    from planner.presets import preset_models
    return {"anyOf": [{"type": "string", "enum": preset_models()},
                      {"type": "string", "maxLength": MAX_STRING, "pattern": r"\.gguf$"}]}
