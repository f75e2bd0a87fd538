"""Options declared once: a dataclass field per option carries its default, its check, its
help line and its command-line flag. The keyword API (``rewrite_onnx_model(**options)``,
``rewrite(**options)``, the compile backend's ``options=``), the CLI flags and the argument
checks are all derived from those fields, so an option is added, renamed or documented in one
place (docs/decisions/0036-one-pipeline-contract.md).

Framework-free: the checks here know numbers, strings, paths and patterns; an adapter adds
its own (a torch dtype, a device) as plain functions in the field's ``check``.
"""
from __future__ import annotations

import dataclasses
import difflib
import inspect
import math
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from amp_rewrite.errors import UsageError

__all__ = ["ArgumentError", "Cli", "UnknownOptionError", "add_flags", "checked", "choice",
           "comma_patterns", "describe", "file_path", "flag", "from_flags", "max_error",
           "max_evaluations", "option", "option_names", "optional_int", "optional_number",
           "paths", "patterns", "positive_number", "signature"]


class ArgumentError(UsageError, ValueError):
    """A public function got an argument of the wrong type or value."""


class UnknownOptionError(ArgumentError, TypeError):
    """A keyword no option of that entry point has (a TypeError, as Python's own is)."""


_META = "amp_rewrite.option"


@dataclass(frozen=True)
class Cli:
    """How an option appears on the command line. ``action``: ``"value"`` (``--x V``),
    ``"append"`` (repeatable), ``"true"`` (``--x`` sets True) or ``"false"`` (``--no-x``
    sets False); ``name``: the flag when it is not ``--`` + the field name with dashes."""

    action: str = "value"
    name: str | None = None
    metavar: str | None = None
    type: Callable | None = None
    choices: tuple[str, ...] | None = None
    default: Any = None  # the CLI's default, when it differs from the keyword's
    has_default: bool = False  # whether ``default`` is set (None may be one)

    def flag(self, field_name: str) -> str:
        if self.name:
            return self.name
        stem = field_name.replace("_", "-")
        return f"--no-{stem}" if self.action == "false" else f"--{stem}"


@dataclass(frozen=True)
class _Meta:
    help: str
    check: Callable[[Any, str], Any] | None
    cli: Cli | None
    scope: str


def option(default: Any = None, *, help: str, check: Callable[[Any, str], Any] | None = None,
           cli: Cli | None = None, scope: str = "") -> Any:
    """A dataclass field declaring one option. ``check(value, name)`` returns the value as
    the pipeline takes it or raises ``ArgumentError``; ``scope`` groups options an entry
    point takes together (the compile backend takes only the per-graph ones)."""
    meta = {_META: _Meta(help, check, cli, scope)}
    if isinstance(default, (list, dict, set)):
        raise TypeError("option defaults are immutable: use a tuple")
    return dataclasses.field(default=default, metadata=meta)


def _meta(f: dataclasses.Field) -> _Meta:
    return f.metadata[_META]


def option_names(cls: type, scopes: Iterable[str] | None = None) -> list[str]:
    """The options of ``cls`` in declaration order (only those in ``scopes`` if given)."""
    wanted = None if scopes is None else set(scopes)
    return [f.name for f in dataclasses.fields(cls)
            if _META in f.metadata and (wanted is None or _meta(f).scope in wanted)]


def checked(cls: type, keywords: Mapping[str, Any], *, where: str,
            scopes: Iterable[str] | None = None, names: Mapping[str, str] | None = None
            ) -> Any:
    """An instance of ``cls`` from user keywords: unknown names fail with the nearest known
    one, every given value passes its field's check (defaults are trusted). ``names``: how
    the user spelled each option (the CLI's flags), for the messages."""
    known = option_names(cls, scopes)
    unknown = sorted(set(keywords) - set(known))
    if unknown:
        near = difflib.get_close_matches(unknown[0], known, n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise UnknownOptionError(f"{where}() got an unexpected option {unknown[0]!r}{hint}; "
                                 f"options: {', '.join(known)}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values_ = {}
    for name, value in keywords.items():
        check = _meta(fields[name]).check
        spelled = (names or {}).get(name, name)
        values_[name] = check(value, spelled) if check is not None else value
    return cls(**values_)


def signature(function: Callable, cls: type, scopes: Iterable[str] | None = None
              ) -> inspect.Signature:
    """``function``'s signature with its ``**options`` spelled out as the keyword-only
    options of ``cls``: what ``help()`` and editors show."""
    sig = inspect.signature(function)
    params = [p for p in sig.parameters.values() if p.kind is not p.VAR_KEYWORD]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    taken = {p.name for p in params}
    params += [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY,
                                 default=fields[name].default)
               for name in option_names(cls, scopes) if name not in taken]
    return sig.replace(parameters=params)


def describe(cls: type, scopes: Iterable[str] | None = None) -> str:
    """The options as docstring lines: ``name`` (default): help."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    lines = []
    for name in option_names(cls, scopes):
        f = fields[name]
        default = getattr(f.default, "value", f.default)  # an enum as its spelling
        lines.append(f"``{name}`` (default {default!r}): {_meta(f).help}")
    return "\n".join(lines)


def add_flags(parser: Any, cls: type, scopes: Iterable[str] | None = None) -> None:
    """One argparse flag per option of ``cls`` that declares a ``Cli``."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for name in option_names(cls, scopes):
        meta = _meta(fields[name])
        if meta.cli is None:
            continue
        cli = meta.cli
        default = cli.default if cli.has_default else fields[name].default
        kwargs: dict[str, Any] = {"dest": name, "help": meta.help}
        if cli.action == "true":
            kwargs.update(action="store_true")
        elif cli.action == "false":  # the help says what the option does; the flag undoes it
            kwargs.update(action="store_false", help=f"turn off (on by default): {meta.help}")
        elif cli.action == "append":
            kwargs.update(action="append", default=[], metavar=cli.metavar)
        else:
            kwargs.update(default=default, metavar=cli.metavar, type=cli.type,
                          choices=cli.choices)
        parser.add_argument(cli.flag(name), **{k: v for k, v in kwargs.items()
                                               if v is not None or k == "default"})


def from_flags(cls: type, namespace: Any, scopes: Iterable[str] | None = None,
               ) -> tuple[dict[str, Any], dict[str, str]]:
    """The keywords the parsed flags give (options without a flag keep their defaults),
    and each option's flag, for ``checked``'s messages."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    given = [name for name in option_names(cls, scopes) if _meta(fields[name]).cli is not None]
    return ({name: getattr(namespace, name) for name in given},
            {name: _meta(fields[name]).cli.flag(name) for name in given})


def flag(value: object, name: str) -> bool:
    """A real bool: ``keep_io_types="no"`` is truthy and would silently mean True."""
    if not isinstance(value, bool):
        raise ArgumentError(f"{name}={value!r}: expected True or False")
    return value


def patterns(value: object, name: str) -> tuple[str, ...]:
    """Glob strings from a string or an iterable of strings; commas separate several in one
    string (``"past.*,present.*"``, as on the command line)."""
    if isinstance(value, (str, os.PathLike)):
        value = [value]
    if not isinstance(value, Iterable):
        raise ArgumentError(f"{name}={value!r}: expected a string or a list of strings")
    items = list(value)
    bad = [item for item in items if not isinstance(item, str)]
    if bad:
        raise ArgumentError(f"{name} holds {bad[0]!r} ({type(bad[0]).__name__}): expected "
                            "strings")
    return tuple(items)


def comma_patterns(value: object, name: str) -> tuple[str, ...]:
    """``patterns`` whose entries may be comma-separated lists."""
    return tuple(p.strip() for entry in patterns(value, name) for p in entry.split(",")
                 if p.strip())


def paths(value: object, name: str) -> tuple[str, ...]:
    """File paths from one path or an iterable of them."""
    items = [value] if isinstance(value, (str, os.PathLike)) else value
    items = list(items) if isinstance(items, Iterable) else None
    if items is None or not all(isinstance(v, (str, os.PathLike)) for v in items):
        raise ArgumentError(f"{name}={value!r}: expected a file path or a list of them")
    return tuple(map(str, items))


def choice(options: tuple[str, ...]) -> Callable[[Any, str], str]:
    """A check accepting exactly one of ``options``."""
    def check(value: Any, name: str) -> str:
        if value not in options:
            raise ArgumentError(f"{name}={value!r}: expected one of "
                                f"{', '.join(map(repr, options))}")
        return value
    return check


def max_error(value: object, name: str = "max_error") -> float | None:
    """None, or a finite number >= 0: the accuracy budget (relative output error)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value < 0:
        raise ArgumentError(f"{name}={value!r}: expected a finite number >= 0 (a relative "
                            "output error such as 1e-2)")
    return float(value)


def max_evaluations(value: object, name: str = "max_evaluations") -> int:
    """An int >= 2: the default plan and the all-pinned plan are always measured."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 2:
        raise ArgumentError(f"{name}={value!r}: expected an int >= 2 (the default plan and "
                            "the all-fp32 plan are measured first)")
    return value


def optional_number(value: object, name: str) -> float | None:
    """None or a finite number."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value):
        raise ArgumentError(f"{name}={value!r}: expected a finite number")
    return float(value)


def positive_number(value: object, name: str) -> float | None:
    """None or a finite number > 0 (a magnitude)."""
    number = optional_number(value, name)
    if number is not None and not number > 0:
        raise ArgumentError(f"{name}={value!r}: expected a magnitude > 0")
    return number


def optional_int(value: object, name: str) -> int | None:
    """None or an int."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise ArgumentError(f"{name}={value!r}: expected an int")
    return value


def file_path(value: object, name: str) -> str | os.PathLike | None:
    """A path (str or os.PathLike); None passes."""
    if value is not None and not isinstance(value, (str, os.PathLike)):
        raise ArgumentError(f"{name}={value!r}: expected a file path")
    return value
