"""Op-class rule files (docs/design.md §6): defaults, overlays, environment variables.

Load order, later wins: the packaged ``rules/<domain>.toml``; each ``--rules`` file; each file in
``AMP_REWRITE_RULES`` (os.pathsep-separated); then ``AMP_REWRITE_<CLASS>_ADD`` and
``AMP_REWRITE_<CLASS>_REMOVE`` (comma-separated op keys), ADD before REMOVE.

Besides the four class tables, a file may hold a ``[bounded_output]`` table (op = "reason",
like a class entry): ops whose *output* is bounded (``|cos x| ≤ 1``) whatever their class.
Such an op that runs fp32 because of its *input* (deny: an fp16 angle loses phase) does not
start deny propagation: gray/clear ops downstream of it stay free and the min cut decides where
its output is cast. Overlays add entries; ``AMP_REWRITE_BOUNDED_OUTPUT_ADD`` and ``_REMOVE``
apply last, like the class variables.

A ``[range]`` table (op = "reason") names ops that need range more than precision: in a
mixed plan (``--dtype mixed``) they run bf16 where their class or fp16's range would keep
them fp32 (a sum of squares overflows fp16; bf16's 8-bit mantissa is enough for it). In fp16
and bf16 plans the table changes nothing. ``AMP_REWRITE_RANGE_ADD`` and ``_REMOVE`` apply
last, as for ``[bounded_output]``.

A ``[keep_fp32]`` table (node-name fnmatch pattern = "reason") pins nodes fp32 as
``--keep-fp32`` does, with the reason ``--explain`` prints; ``[keep_low]`` runs nodes low over
the rule classes and calibration (not over what the adapter or the range screen fixes). The
accuracy budget's ``--emit-rules`` writes both, reproducing the budgeted plan without search.
"""
from __future__ import annotations

import difflib
import importlib.resources
import logging
import os
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from amp_rewrite.core.precision import OpClass
from amp_rewrite.errors import RuleFileError

logger = logging.getLogger(__name__)
SCHEMA_VERSION = 1
RULE_CLASSES = (OpClass.ALLOW, OpClass.DENY, OpClass.GRAY, OpClass.CLEAR)
ENV_FILES = "AMP_REWRITE_RULES"
ENV_PREFIX = "AMP_REWRITE_"
# Variables of the package that are not rule lists (runtime, bench and tools read them).
BOUNDED_OUTPUT = "bounded_output"  # the table of ops whose output is bounded (module docstring)
RANGE = "range"  # the table of ops needing range more than precision (module docstring)
KEEP_FP32 = "keep_fp32"  # the table of node-name patterns pinned fp32 (module docstring)
KEEP_LOW = "keep_low"  # the table of node-name patterns run low (module docstring)
OTHER_ENV_VARS = frozenset({"AMP_REWRITE_CACHE", "AMP_REWRITE_MODELOPT_PYTHON",
                            "AMP_REWRITE_FUSED_BACKEND", "AMP_REWRITE_FORK"})


def env_op_list_names() -> list[str]:
    """``AMP_REWRITE_<CLASS>_ADD`` and ``_REMOVE`` for every rule class."""
    return [f"{ENV_PREFIX}{name.upper()}_{verb}" for verb in ("ADD", "REMOVE")
            for name in [*(c.value for c in RULE_CLASSES), BOUNDED_OUTPUT, RANGE]]


def known_env_vars() -> list[str]:
    return sorted({ENV_FILES, *env_op_list_names(), *OTHER_ENV_VARS})


def close_match(word: str, choices: Iterable[str]) -> str:
    """" (did you mean X?)" for the nearest choice, or "" when none is near."""
    match = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    if not match and word.lower() != word:
        match = [c for c in choices if c.lower() == word.lower()][:1]
    return f" (did you mean {match[0]}?)" if match else ""


@dataclass(frozen=True)
class RuleEntry:
    """One op's class, why, and which file or variable said so."""

    op: str
    op_class: OpClass
    reason: str
    source: str


@dataclass(frozen=True)
class PinEntry:
    """A node-name pattern pinned fp32 (``[keep_fp32]``), why, and which file said so."""

    pattern: str
    reason: str
    source: str
    low: bool = False  # from [keep_low]: run low instead of fp32


@dataclass(frozen=True)
class BoundedEntry:
    """One op whose output is bounded (``[bounded_output]``), why, and who said so."""

    op: str
    reason: str
    source: str


class RuleSet:
    """The effective op → class mapping after all overlays, and the bounded-output ops."""

    def __init__(self, entries: Iterable[RuleEntry] = (),
                 bounded: Iterable[BoundedEntry] = (), pins: Iterable[PinEntry] = (),
                 range_ops: Iterable[BoundedEntry] = ()) -> None:
        self._entries: dict[str, RuleEntry] = {e.op: e for e in entries}
        self._bounded: dict[str, BoundedEntry] = {e.op: e for e in bounded}
        self.pins: tuple[PinEntry, ...] = tuple({(e.pattern, e.low): e for e in pins}.values())
        self._range: dict[str, BoundedEntry] = {e.op: e for e in range_ops}

    def classify(self, op_key: str) -> RuleEntry | None:
        return self._entries.get(op_key)

    def class_of(self, op_key: str) -> OpClass:
        entry = self._entries.get(op_key)
        return entry.op_class if entry else OpClass.UNLISTED

    def entries(self) -> list[RuleEntry]:
        return sorted(self._entries.values(), key=lambda e: (e.op_class.value, e.op))

    def has_bounded_output(self, op_key: str) -> bool:
        """True when ``op_key``'s output is bounded: as deny it starts no deny propagation."""
        return op_key in self._bounded

    def bounded_entries(self) -> list[BoundedEntry]:
        return sorted(self._bounded.values(), key=lambda e: e.op)

    def needs_range(self, op_key: str) -> bool:
        """True when ``op_key`` needs range more than precision: bf16 in a mixed plan."""
        return op_key in self._range

    def range_entry(self, op_key: str) -> BoundedEntry | None:
        return self._range.get(op_key)

    def range_entries(self) -> list[BoundedEntry]:
        return sorted(self._range.values(), key=lambda e: e.op)

    def overlay(self, entries: Iterable[RuleEntry], bounded: Iterable[BoundedEntry] = (),
                pins: Iterable[PinEntry] = (), range_ops: Iterable[BoundedEntry] = ()
                ) -> RuleSet:
        return RuleSet([*self._entries.values(), *entries], [*self._bounded.values(), *bounded],
                       [*self.pins, *pins], [*self._range.values(), *range_ops])

    def without(self, op_class: OpClass, ops: Iterable[str]) -> RuleSet:
        drop = set(ops)
        return RuleSet((e for e in self._entries.values()
                        if not (e.op in drop and e.op_class is op_class)),
                       self._bounded.values(), self.pins, self._range.values())

    def without_bounded(self, ops: Iterable[str]) -> RuleSet:
        drop = set(ops)
        return RuleSet(self._entries.values(),
                       (e for e in self._bounded.values() if e.op not in drop), self.pins,
                       self._range.values())

    def without_range(self, ops: Iterable[str]) -> RuleSet:
        drop = set(ops)
        return RuleSet(self._entries.values(), self._bounded.values(), self.pins,
                       (e for e in self._range.values() if e.op not in drop))


def default_rules_path(domain: str) -> Path:
    """Path of the packaged rule file for ``domain`` ('onnx' or 'torch')."""
    resource = importlib.resources.files("amp_rewrite.rules") / f"{domain}.toml"
    path = Path(str(resource))
    if not path.is_file():
        raise RuleFileError(f"packaged rule file {path} is missing: reinstall amp_rewrite")
    return path


def parse_rule_file(path: str | Path) -> list[RuleEntry]:
    """Parse and validate one rule file's class tables; every problem is a RuleFileError
    naming file and key. ``parse_bounded_output`` reads its ``[bounded_output]`` table."""
    path = Path(path)
    data = _read_rule_file(path)
    entries: dict[str, RuleEntry] = {}
    for class_name, table in data.items():
        if class_name in ("schema", BOUNDED_OUTPUT, RANGE, KEEP_FP32, KEEP_LOW):
            continue
        op_class = _parse_class(path, class_name, table)
        for op, reason in table.items():
            reason = _reason(path, class_name, op, reason)
            if op in entries:
                raise RuleFileError(
                    f"{path}: op {op!r} is in both [{entries[op].op_class.value}] and "
                    f"[{class_name}]; keep it in one class")
            entries[op] = RuleEntry(op, op_class, reason, str(path))
    return list(entries.values())


def parse_bounded_output(path: str | Path) -> list[BoundedEntry]:
    """The ``[bounded_output]`` table of one rule file (empty when it has none)."""
    return parse_op_table(path, BOUNDED_OUTPUT)


def parse_op_table(path: str | Path, name: str) -> list[BoundedEntry]:
    """An op = "reason" table that is not a class (``[bounded_output]``, ``[range]``) of one
    rule file (empty when it has none)."""
    path = Path(path)
    table = _read_rule_file(path).get(name, {})
    if not isinstance(table, dict):
        raise RuleFileError(f"{path}: [{name}] must be a table of op = \"reason\"")
    return [BoundedEntry(op, _reason(path, name, op, reason), str(path))
            for op, reason in table.items()]


def parse_pins(path: str | Path) -> list[PinEntry]:
    """The ``[keep_fp32]`` and ``[keep_low]`` tables of one rule file (empty when none)."""
    path = Path(path)
    data = _read_rule_file(path)
    entries = []
    for name in (KEEP_FP32, KEEP_LOW):
        table = data.get(name, {})
        if not isinstance(table, dict):
            raise RuleFileError(f"{path}: [{name}] must be a table of "
                                "\"node-name pattern\" = \"reason\"")
        entries += [PinEntry(pattern, _reason(path, name, pattern, reason), str(path),
                             name == KEEP_LOW) for pattern, reason in table.items()]
    return entries


def _read_rule_file(path: Path) -> dict:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise RuleFileError(f"{path}: rule file not found") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise RuleFileError(f"{path}: not valid TOML ({e})") from None
    schema = data.get("schema")
    if schema != SCHEMA_VERSION:
        raise RuleFileError(
            f"{path}: 'schema' must be {SCHEMA_VERSION}, got {schema!r}; "
            f"add 'schema = {SCHEMA_VERSION}' at the top")
    return data


def _parse_class(path: Path, class_name: str, table: object) -> OpClass:
    names = [c.value for c in RULE_CLASSES]
    if class_name not in names:
        raise RuleFileError(f"{path}: unknown class [{class_name}]; expected one of {names} "
                            f"(or [{BOUNDED_OUTPUT}], [{RANGE}], [{KEEP_FP32}], [{KEEP_LOW}])")
    if not isinstance(table, dict):
        raise RuleFileError(f"{path}: [{class_name}] must be a table of op = \"reason\"")
    return OpClass(class_name)


def _reason(path: Path, table: str, key: str, reason: object) -> str:
    """A table entry's reason, stripped; a RuleFileError unless a non-empty string."""
    if not isinstance(reason, str) or not reason.strip():
        raise RuleFileError(
            f"{path}: [{table}] {key}: the value must be a non-empty reason string")
    return reason.strip()


def _env_op_list(env: Mapping[str, str], name: str) -> list[str]:
    return [op.strip() for op in env.get(name, "").split(",") if op.strip()]


def _apply_env(rules: RuleSet, env: Mapping[str, str]) -> RuleSet:
    for op_class in RULE_CLASSES:
        name = f"AMP_REWRITE_{op_class.value.upper()}_ADD"
        added = [RuleEntry(op, op_class, f"added by ${name}", f"${name}")
                 for op in _env_op_list(env, name)]
        rules = rules.overlay(added)
    for op_class in RULE_CLASSES:
        name = f"AMP_REWRITE_{op_class.value.upper()}_REMOVE"
        rules = rules.without(op_class, _env_op_list(env, name))
    name = f"{ENV_PREFIX}{BOUNDED_OUTPUT.upper()}"
    rules = rules.overlay([], [BoundedEntry(op, f"added by ${name}_ADD", f"${name}_ADD")
                               for op in _env_op_list(env, f"{name}_ADD")])
    rules = rules.without_bounded(_env_op_list(env, f"{name}_REMOVE"))
    name = f"{ENV_PREFIX}{RANGE.upper()}"
    rules = rules.overlay([], range_ops=[BoundedEntry(op, f"added by ${name}_ADD",
                                                      f"${name}_ADD")
                                         for op in _env_op_list(env, f"{name}_ADD")])
    return rules.without_range(_env_op_list(env, f"{name}_REMOVE"))


def load_rules(domain: str, extra_files: Iterable[str | Path] = (),
               env: Mapping[str, str] | None = None,
               known_ops: Iterable[str] | None = None) -> RuleSet:
    """The effective rules for ``domain`` ('onnx' or 'torch'), overlays and env applied.

    ``known_ops``: op keys the adapter knows besides the packaged ones; given, an overlay or
    variable naming any other op of a known domain gets a warning with the closest name.
    """
    env = os.environ if env is None else env
    packaged_path = default_rules_path(domain)
    packaged = parse_rule_file(packaged_path)
    rules = RuleSet(packaged, parse_bounded_output(packaged_path),
                    range_ops=parse_op_table(packaged_path, RANGE))
    env_files = [p for p in env.get(ENV_FILES, "").split(os.pathsep) if p]
    overlays = []
    for path in [*extra_files, *env_files]:
        overlays.append(parse_rule_file(path))
        rules = rules.overlay(overlays[-1], parse_bounded_output(path), parse_pins(path),
                              parse_op_table(path, RANGE))
    warn_env_names(env)
    if known_ops is not None:
        known = {e.op for e in packaged} | set(known_ops)
        for entry in (e for entries in overlays for e in entries):
            _warn_unknown_op(entry.op, entry.source, known)
        for name in env_op_list_names():
            for op in _env_op_list(env, name):
                _warn_unknown_op(op, f"${name}", known)
    return _apply_env(rules, env)


def _warn_unknown_op(op: str, source: str, known: set[str]) -> None:
    """Custom domains (``acme::Op``) are the user's own: only ops of a domain some known op
    has are checked."""
    if op in known:
        return
    domain = op.split("::")[0] if "::" in op else ""
    if domain and not any(k.startswith(f"{domain}::") for k in known):
        return
    logger.warning("%s: unknown op %r%s; the entry has no effect unless a model has this op",
                   source, op, close_match(op, known))


def warn_env_names(env: Mapping[str, str]) -> None:
    """Misspelt variable names and ops added to two classes at once, each a warning."""
    known = known_env_vars()
    for name in sorted(env):
        if name.startswith(ENV_PREFIX) and name not in known:
            logger.warning("unknown environment variable $%s ignored%s", name,
                           close_match(name, known))
    added: dict[str, str] = {}
    for c in RULE_CLASSES:
        name = f"{ENV_PREFIX}{c.value.upper()}_ADD"
        for op in _env_op_list(env, name):
            if op in added and added[op] != name:
                logger.warning("op %r is in both $%s and $%s; the later class (%s) wins",
                               op, added[op], name, c.value)
            added[op] = name
