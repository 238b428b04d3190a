"""Run files: a command's options kept in a TOML file (``jaxpar train --config run.toml``).

Every option has a key of the same name (``batch-size`` or ``batch_size``); options given on the
command line override the file's. A run's resolved record, every option with the value the run
used plus jaxpar's and jax's versions, is kept in each of its checkpoints and in its metrics file,
and ``--config`` of either (the checkpoint directory, or the metrics JSON) repeats the run; the
keys of its ``[recorded]`` table (versions, when) are not options. ``record_text`` writes a record
as a run file to edit.

Standard library only (``tomllib``): this sits low, under the command line that uses it.
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
import os
import tomllib

from jaxpar.errors import JaxparError

RECORDED = "recorded"  # the table of a record that is not options
SKIP = {"config", "help"}  # options a run file does not hold


def options_of(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """{key: action} of a command's options: the long option without its dashes."""
    return {s[2:]: a for a in parser._actions for s in a.option_strings if s.startswith("--") and s[2:] not in SKIP}


def read(path: str, checkpoint_record=None) -> dict:
    """The options in a run file: TOML, the JSON metrics file of a run (its ``run`` record), or
    with ``checkpoint_record(directory)``, a checkpoint directory's newest record."""
    if os.path.isdir(path) and checkpoint_record is not None:
        values = dict(checkpoint_record(path))
        values.pop(RECORDED, None)
        return values
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as err:
        raise JaxparError(f"--config {path} cannot be read ({err.strerror}); give a run file (TOML) or a run's metrics JSON") from None
    try:
        values = json.loads(raw)["run"] if path.endswith(".json") else tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as err:
        raise JaxparError(f"--config {path} is not a run file ({str(err)[:160]}); write key = value lines, e.g. "
                          f"batch-size = 16") from None
    values = dict(values)
    values.pop(RECORDED, None)
    return values


def as_argv(values: dict, options: dict[str, argparse.Action], path: str) -> list[str]:
    """The command-line words that say what ``values`` say; an unknown key is refused with the
    nearest option."""
    argv = []
    for key, value in values.items():
        name = key.replace("_", "-")
        if name not in options:
            near = difflib.get_close_matches(name, list(options), n=1)
            hint = f"did you mean {near[0]!r}?" if near else f"the options are {', '.join(sorted(options))}"
            raise JaxparError(f"--config {path}: {key!r} is not an option of this command; {hint}")
        action = options[name]
        if isinstance(value, dict | list):
            raise JaxparError(f"--config {path}: {key} = {value!r} is not one value; give a number, a string or true/false")
        if action.nargs == 0:  # a switch: true gives it, false leaves it out
            if not isinstance(value, bool):
                raise JaxparError(f"--config {path}: {key} is a switch; give true or false, not {value!r}")
            argv += [f"--{name}"] if value else []
        elif isinstance(value, bool) and list(action.choices or []) == ["on", "off"]:
            argv.append(f"--{name}={'on' if value else 'off'}")
        else:
            argv.append(f"--{name}={value}")
    return argv


def with_config(argv: list[str], options: dict[str, argparse.Action], checkpoint_record=None) -> list[str]:
    """``argv`` with the options of its ``--config FILE`` (``read``) put first after the command
    word, so that those on the command line, which come later, override them."""
    for i, word in enumerate(argv):
        if word == "--config" or word.startswith("--config="):
            path = word.split("=", 1)[1] if "=" in word else (argv[i + 1] if i + 1 < len(argv) else None)
            if not path:
                raise JaxparError("--config needs a file: --config run.toml")
            first = next(k for k, w in enumerate(argv) if not w.startswith("-"))
            return argv[:first + 1] + as_argv(read(path, checkpoint_record), options, path) + argv[first + 1:]
    return argv


def resolved(args: argparse.Namespace, options: dict[str, argparse.Action]) -> dict:
    """Every option's value as the command ran with it (None: not given, no default), by key."""
    out = {}
    for key, action in sorted(options.items()):
        value = getattr(args, action.dest, None)
        if value is not None and value is not False:
            out[key] = value
    return out


def record_text(values: dict, recorded: dict) -> str:
    """A run file (TOML) of ``values`` and, in its ``[recorded]`` table, ``recorded``."""
    lines = [f"{key} = {_toml(value)}" for key, value in values.items()]
    lines += ["", f"[{RECORDED}]"] + [f"{key} = {_toml(value)}" for key, value in recorded.items()]
    return "\n".join(lines) + "\n"


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, int | float):
        return repr(value)
    return json.dumps(str(value), ensure_ascii=False)  # a JSON string is a TOML basic string
