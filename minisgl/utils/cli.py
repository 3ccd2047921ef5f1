"""One declaration per knob: a config dataclass field that is also its command-line option.

    page_size: int = knob(1, "tokens per KV page", group=SCHEDULING, type=positive_int)

`knob()` is `dataclasses.field()` with the option in the field's metadata: its help, and where
they differ from the field's, its flag names, argparse type, choices, or what a switch or a named
choice sets the field to. `server/args.py` builds the parser from the fields of ServerArgs and
SchedulerConfig (EngineConfig's included) and turns the parsed namespace back into field values;
docs/SERVER.md's table is tested against the resulting `--help` (tests/test_cli_docs.py).

Torch-free: the API server parses its command line without importing the engine.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Tuple

# the groups of `--help`, in its order
MODEL = "model"
SCHEDULING = "scheduling and KV cache"
SERVER = "server"
MULTI_NODE = "tensor parallelism over several machines"
GROUPS = (MODEL, SCHEDULING, SERVER, MULTI_NODE)

_NOT_A_SWITCH = object()


@dataclass(frozen=True)
class Option:
    help: str
    group: str
    flags: Tuple[str, ...] = ()  # () means --field-name
    type: Callable[[str], Any] | None = None
    choices: Tuple[str, ...] | None = None
    # a flag without a value that sets the field to this (the field's default otherwise)
    switch: Any = _NOT_A_SWITCH
    # the flag takes these names and the field gets the value each stands for (--load-format dummy)
    values: Mapping[str, Any] | None = None
    # what --help (and the docs) give as the default when the field's default is None (decided later)
    default_text: str | None = None
    # the parser's default, read when the parser is built (an environment variable); None: the field's
    parser_default: Callable[[], Any] | None = None
    # a boolean with a --no-<flag> twin (argparse.BooleanOptionalAction); the field's default when neither is given
    negatable: bool = False

    @property
    def is_switch(self) -> bool:
        return self.switch is not _NOT_A_SWITCH


def knob(
    default: Any,
    help: str,
    *,
    group: str,
    flags: Tuple[str, ...] = (),
    type: Callable[[str], Any] | None = None,
    choices: Tuple[str, ...] | None = None,
    switch: Any = _NOT_A_SWITCH,
    values: Mapping[str, Any] | None = None,
    default_text: str | None = None,
    parser_default: Callable[[], Any] | None = None,
    negatable: bool = False,
) -> Any:
    """A dataclass field with a default that is also the command-line option described here."""
    assert group in GROUPS, group
    option = Option(help, group, flags, type, choices, switch, values, default_text, parser_default, negatable)
    if not option.is_switch:
        # every valued option states its default in --help, so docs/SERVER.md can be checked against it
        assert (default is None) == (default_text is not None), f"a None default needs default_text, and only it has one: {help!r}"
    return dataclasses.field(default=default, metadata={"cli": option})


def options(cls: type) -> List[Tuple[dataclasses.Field, Option]]:
    """The fields of dataclass `cls` (inherited ones included) that are command-line options."""
    return [(f, f.metadata["cli"]) for f in dataclasses.fields(cls) if "cli" in f.metadata]


def flag_names(f: dataclasses.Field, option: Option) -> Tuple[str, ...]:
    return option.flags or ("--" + f.name.replace("_", "-"),)


def _cli_default(f: dataclasses.Field, option: Option) -> Any:
    if option.parser_default is not None:
        return option.parser_default()
    if option.values is not None:
        return next(name for name, value in option.values.items() if value == f.default)
    return f.default


def shown_default(f: dataclasses.Field, option: Option) -> str | None:
    """The default as `--help` states it (None for a switch: it is off unless given)."""
    if option.is_switch:
        return None
    if option.default_text is not None:
        return option.default_text
    return str(_cli_default(f, option))


def add_options(groups: Dict[str, Any], cls: type) -> None:
    """Add the options of `cls` to the argparse groups (by group name); dest = field name."""
    for f, option in options(cls):
        shown = shown_default(f, option)
        help_text = (option.help if shown is None else f"{option.help} (default: {shown})").replace("%", "%%")
        group = groups[option.group]
        if option.is_switch:
            group.add_argument(
                *flag_names(f, option), dest=f.name, action="store_const", const=option.switch, default=f.default, help=help_text
            )
            continue
        names = flag_names(f, option)
        if option.negatable:
            group.add_argument(*names, dest=f.name, action=argparse.BooleanOptionalAction, default=f.default, help=help_text)
            continue
        choices = list(option.values) if option.values is not None else option.choices
        metavar = None if choices else names[0].lstrip("-").replace("-", "_").upper()  # as argparse names it by flag
        group.add_argument(
            *names, dest=f.name, type=option.type, choices=choices, default=_cli_default(f, option), metavar=metavar, help=help_text
        )


def field_values(cls: type, namespace: Mapping[str, Any]) -> Dict[str, Any]:
    """The parsed values of the options of `cls`, by field name (named choices resolved)."""
    out: Dict[str, Any] = {}
    for f, option in options(cls):
        value = namespace[f.name]
        out[f.name] = option.values[value] if option.values is not None else value
    return out


# ---- argparse types shared by the configs -------------------------------------------------------


def _bounded(convert: Callable[[str], Any], ok: Callable[[Any], bool], expected: str) -> Callable[[str], Any]:
    """An argparse type: `convert` the text, then refuse what `ok` rejects, naming what is expected."""

    def parse(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {value}")
        return value

    return parse


positive_int = _bounded(int, lambda v: v >= 1, "a positive integer")
nonnegative_int = _bounded(int, lambda v: v >= 0, "a non-negative integer")
positive_float = _bounded(float, lambda v: 0.0 < v <= 1e6, "a number in (0, 1e6]")  # also refuses nan and inf
nonnegative_float = _bounded(float, lambda v: 0.0 <= v <= 1e6, "a number in [0, 1e6]")
ratio = _bounded(float, lambda v: 0.0 < v <= 1.0, "a number in (0, 1]")
