"""KVPP settings as users write them in vLLM's `--additional-config`, and the one way this project
reads user settings: `parse_bool` for flags, `parse_struct` for a typed settings object."""

from __future__ import annotations

import difflib
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import msgspec

ENABLE_KEY = "enable_kvpp"
STAGING_KEY = "kvpp_staging_buffers"
STAGING_RANGE = range(0, 4)
DEFAULT_STAGING = 2
"""The staging mode's buffers, and the mode a launch that names none runs where zero-copy cannot (kvpp_core.modes)."""
ZERO_COPY = 0
"""`kvpp_staging_buffers: 0`: no staging slot; foreign layers are read in place from their owner's pages
(kvpp_core/zero_copy.py), where the group's ranks share host memory: the mode a launch that names none runs
there (kvpp_core.modes)."""


class KvppConfigError(ValueError):
    """A setting the user must change (KVPP's, or a connector's); the message names the option and the fix."""


@dataclass(frozen=True)
class KvppConfig:
    enabled: bool = False
    staging_buffers: int | None = None
    """As the launch names it; None: not named, the mode then follows where it runs (kvpp_core.modes.resolve)."""


def parse_bool(value: Any) -> bool | None:
    """A JSON bool, or the string "true"/"false" in any case (CLI JSON often quotes them); None otherwise."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    return None


def shown(value: object, limit: int = 80) -> str:
    """`value`'s repr, cut to `limit` characters: messages quote what they refuse, on one short line."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


BOOL_HINT = 'must be true or false (a JSON bool, or the string "true"/"false")'
S = TypeVar("S", bound=msgspec.Struct)


@dataclass
class Parsed(Generic[S]):
    value: S | None
    """The struct, or None if any problem was found."""
    given: dict[str, Any] = field(default_factory=dict)
    """Every field the user set that converted cleanly (even when another field failed)."""
    problems: list[tuple[str, str]] = field(default_factory=list)
    """(option, message) pairs, every problem at once; option is `<where>.<key>`."""

    def value_or_raise(self) -> S:
        """The struct, or KvppConfigError listing every problem, one `option: message` per line."""
        if self.value is None:
            raise KvppConfigError("\n".join(f"{option}: {message}" for option, message in self.problems))
        return self.value


def parse_struct(raw: Mapping[str, Any] | None, cls: type[S], where: str,
                 hints: Mapping[str, str] | None = None) -> Parsed[S]:
    """Read user settings into the msgspec struct `cls`: unknown keys are refused with the closest valid
    one and the full list, flags go through `parse_bool`, a field typed as a struct (a settings group
    such as the pool's `mooncake: {...}`) by this same reading under `<where>.<field>`, every other
    field through msgspec's own typed conversion (constraints included); `hints[key]` is appended to
    that key's problem (`hints["group.key"]` for a key of a group). A struct's `field_checks` (a class
    attribute: field name -> problem of a value, or None) run on the values that converted."""
    raw, hints = dict(raw or {}), hints or {}
    checks = getattr(cls, "field_checks", {})
    info = msgspec.inspect.type_info(cls)
    types = typing.get_type_hints(cls, include_extras=True)
    names = [f.name for f in info.fields]
    out: Parsed[S] = Parsed(None)
    for key in raw:
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            guess = f"did you mean {close[0]}? " if close else ""
            out.problems.append((f"{where}.{key}", f"unknown option; {guess}valid options: {', '.join(names)}"))
    for f in info.fields:
        option, hint = f"{where}.{f.name}", f"; {hints[f.name]}" if f.name in hints else ""
        if f.name not in raw:
            if f.required:
                out.problems.append((option, f"is required{hint}"))
            continue
        value = raw[f.name]
        nested = _nested_struct(f.type)
        if nested is not None and isinstance(value, Mapping):  # a settings group: read it the same way
            inner = parse_struct(value, nested, option, {k[len(f.name) + 1:]: v for k, v in hints.items()
                                                         if k.startswith(f"{f.name}.")})
            out.problems += inner.problems
            if inner.value is not None:
                out.given[f.name] = inner.value
            continue
        if isinstance(f.type, msgspec.inspect.BoolType):
            parsed = parse_bool(value)
            if parsed is None:
                out.problems.append((option, f"{BOOL_HINT}, got {value!r}{hint}"))
            else:
                out.given[f.name] = parsed
            continue
        try:
            out.given[f.name] = msgspec.convert(value, types[f.name])
            problem = None if out.given[f.name] is None or f.name not in checks else checks[f.name](out.given[f.name])
            if problem:
                del out.given[f.name]
                out.problems.append((option, f"{problem}, got {value!r}{hint}"))
        except msgspec.ValidationError as exc:
            if isinstance(f.type, msgspec.inspect.LiteralType):
                choices = typing.get_args(types[f.name]) or sorted(f.type.values)  # declared order if plain
                message = f"must be one of {', '.join(map(str, choices))}, got {value!r}"
            else:
                message = f"{exc} ({value!r})" if "got" in str(exc) else f"{exc}, got {value!r}"
            out.problems.append((option, f"{message}{hint}"))
    if not out.problems:
        out.value = cls(**out.given)
    return out


def _nested_struct(t: msgspec.inspect.Type) -> type[msgspec.Struct] | None:
    """The struct type of a field typed `SomeStruct` or `SomeStruct | None`, else None."""
    for member in t.types if isinstance(t, msgspec.inspect.UnionType) else (t,):
        if isinstance(member, msgspec.inspect.StructType):
            return member.cls
    return None


def _parse_enable(value: Any) -> bool:
    parsed = parse_bool(value)
    if parsed is not None:
        return parsed
    raise KvppConfigError(
        f"additional_config.{ENABLE_KEY} must be true or false (a JSON bool, or the string "
        f'"true"/"false"), got {value!r}; write --additional-config \'{{"{ENABLE_KEY}": true}}\''
    )


def _parse_staging(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value not in STAGING_RANGE:
        raise KvppConfigError(
            f"additional_config.{STAGING_KEY} must be an integer from {STAGING_RANGE.start} to "
            f"{STAGING_RANGE.stop - 1} (2 overlaps the next layer's broadcast with compute; 1 saves "
            f"memory but serialises them; 0 copies nothing, reading foreign layers in their owner's "
            f"shared host memory; left out, 0 where that can run, else 2), got {value!r}"
        )
    return value


def parse_additional_config(additional: Mapping[str, Any] | None) -> KvppConfig:
    """Read the KVPP keys of vLLM's additional_config; other plugins' keys are left alone."""
    additional = dict(additional or {})
    if "kvpp_size" in additional:
        raise KvppConfigError(
            "additional_config.kvpp_size is not supported: the KVPP group is always the TP ranks of a "
            "PP stage (PCP x TP with PCP); remove kvpp_size and set only "
            f'{{"{ENABLE_KEY}": true}}'
        )
    known = {ENABLE_KEY, STAGING_KEY}
    unknown = sorted(k for k in additional if k.startswith("kvpp") and k not in known)
    if unknown:
        raise KvppConfigError(
            f"additional_config has unknown KVPP option(s) {', '.join(unknown)}; the only KVPP keys "
            f"are {ENABLE_KEY} and {STAGING_KEY} (broadcast granularity and group size are not knobs)"
        )
    enabled = _parse_enable(additional[ENABLE_KEY]) if ENABLE_KEY in additional else False
    staging = _parse_staging(additional[STAGING_KEY]) if STAGING_KEY in additional else None
    return KvppConfig(enabled=enabled, staging_buffers=staging)
