"""Command-line options declared once, on the config dataclasses' fields.

A field declared with ``flag(...)`` carries its option: the name, help, choices or type, how a
parsed value becomes the field's value, and the commands that take it. ``add_flags`` adds a config
class's options to a command's parser; ``config_from_args`` builds the config back from the parsed
arguments. So a new option is one field and its help, and no edit to the command line::

    @dataclasses.dataclass(frozen=True)
    class TrainConfig:
        microbatches: int = flag(1, help="gradient accumulation steps", commands=("train", "compile"))

Standard library only: this sits in the bottom layer, under every module that declares a config.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Mapping, Sequence

KEY = "jaxpar.flag"  # where a field's Flag sits in its metadata

# an on|off option for a bool field
ON_OFF = {"choices": ["on", "off"], "to_config": lambda value: value == "on", "from_config": lambda on: "on" if on else "off"}

# annotations whose option is parsed by the type itself (str: no conversion)
_SCALARS = {"int": int, "float": float, "str": None}


@dataclasses.dataclass(frozen=True)
class Flag:
    """A field's option; ``flag`` documents each part."""
    help: str | Mapping[str, str] | None
    name: str | None
    choices: Sequence | None
    type: Callable | None
    action: str | None
    metavar: str | None
    group: str | None
    to_config: Callable | None
    from_config: Callable | None
    given: bool
    commands: tuple[str, ...]


def flag(default=dataclasses.MISSING, help=None, *, name=None, choices=None, type=None, action=None, metavar=None, group=None,
         to_config=None, from_config=None, given=False, commands=("train",)):
    """A dataclass field with ``default`` whose option is declared here.

    ``help``: the option's help, or {command: help} where the commands word it differently (a
    command left out shows none); ``name``: the option without its ``--`` (default: the field's name
    with dashes); ``choices``, ``type``, ``action``, ``metavar``: as argparse's (``type`` defaults to
    the field's int or float annotation); ``group``: the title of the argument group it is shown in;
    ``to_config`` / ``from_config``: the parsed value to the field's, and the field's default to the
    option's (e.g. ``ON_OFF``); ``given``: the option defaults to None, so that a value given on
    purpose is told from the default (``given_flags``) while the field keeps its default when it is
    not; ``commands``: those that take it."""
    commands = tuple(commands)
    if isinstance(help, Mapping) and not set(help) <= set(commands):  # a typo would hide the help silently
        raise ValueError(f"help for {sorted(set(help) - set(commands))}, which are not in commands={commands}")
    spec = Flag(help, name, choices, type, action, metavar, group, to_config, from_config, given, commands)
    return dataclasses.field(default=default, metadata={KEY: spec})


def _declared(cls, command: str) -> list[tuple[dataclasses.Field, Flag]]:
    """(field, its Flag) of each field of ``cls`` that ``command`` takes, in declaration order."""
    return [(f, f.metadata[KEY]) for f in dataclasses.fields(cls) if KEY in f.metadata and command in f.metadata[KEY].commands]


def option_name(field: dataclasses.Field, spec: Flag) -> str:
    return "--" + (spec.name or field.name.replace("_", "-"))


def _dest(field: dataclasses.Field, spec: Flag) -> str:
    return option_name(field, spec)[2:].replace("-", "_")  # as argparse names it


def _parse_type(cls, field: dataclasses.Field, spec: Flag) -> Callable | None:
    """The option's ``type``: declared, or read off an int / float / str annotation (``X | None`` too)."""
    if spec.type or spec.choices or spec.to_config:
        return spec.type
    annotation = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", str(field.type))
    names = {part.strip() for part in annotation.split("|")} - {"None"}
    if len(names) == 1 and next(iter(names)) in _SCALARS:
        return _SCALARS[next(iter(names))]
    # anything else would reach the config as the option's text
    raise TypeError(f"{cls.__name__}.{field.name}: {annotation} is not read from an option by itself; declare type= or to_config=")


def add_flags(target, cls, command: str, defaults=None):
    """Add to ``target`` (a parser or an argument group) the options of the fields of ``cls`` that
    ``command`` takes. ``defaults`` ({field: value}, or an instance of ``cls``) replaces the fields'
    defaults for this command; a ``given`` option's default stays None."""
    if dataclasses.is_dataclass(defaults):
        defaults = {f.name: getattr(defaults, f.name) for f in dataclasses.fields(defaults)}
    defaults = defaults or {}
    groups = vars(target).setdefault("_flag_groups", {})  # one group per title, however many classes fill it
    for field, spec in _declared(cls, command):
        default = None if spec.given else defaults.get(field.name, field.default)
        if default is dataclasses.MISSING:
            default = None
        if spec.from_config and default is not None:
            default = spec.from_config(default)
        kwargs = {"default": default, "help": spec.help.get(command) if isinstance(spec.help, Mapping) else spec.help}
        if spec.action:  # store_true and the like take no type, choices or metavar
            kwargs["action"] = spec.action
        else:
            kwargs.update(type=_parse_type(cls, field, spec), choices=spec.choices, metavar=spec.metavar)
        where = target
        if spec.group:
            if spec.group not in groups:
                groups[spec.group] = target.add_argument_group(spec.group)
            where = groups[spec.group]
        where.add_argument(option_name(field, spec), **kwargs)


def config_from_args(cls, args: argparse.Namespace, command: str, **overrides):
    """``cls`` built from parsed ``args``: each option ``command`` takes gives its field (through
    ``to_config``), one left at None keeps the field's default; ``overrides`` set fields directly."""
    values = {}
    for field, spec in _declared(cls, command):
        value = getattr(args, _dest(field, spec))
        if value is not None:
            values[field.name] = spec.to_config(value) if spec.to_config else value
    return cls(**{**values, **overrides})


def given_flags(cls, args: argparse.Namespace, command: str) -> dict[str, tuple[str, object]]:
    """The ``given`` options of ``cls`` set on the command line: {field: (option, value)}, in
    declaration order (e.g. ``RunConfig.explicit``: fields set on purpose, even to their default)."""
    return {field.name: (option_name(field, spec), getattr(args, _dest(field, spec)))
            for field, spec in _declared(cls, command) if spec.given and getattr(args, _dest(field, spec)) is not None}
