"""Each setting declared once: its environment variable, type, default, bounds, one line of
doc and whether a serving mode may change it. Pure: no I/O (the environment is passed in).

A declaration is a dataclass field (``declared``) or, for a setting no settings object
holds, a module constant (``Setting``). From the declarations come the dataclass defaults,
the parsing of the environment (``read_settings``), the keys a serving mode may set
(``mode_settings``) and the settings reference page (``docs/settings.md``, written by
``python -m tools.settings_doc`` and held equal to them by ``tests/test_settings_declared.py``).
A second declaration of the same variable is an error at import.

>>> from dataclasses import dataclass
>>> @dataclass(frozen=True)
... class Example:
...     port: int = declared("DOCTEST_PORT", 0, "Where it listens (0: off).", minimum=0)
...     ratio: float = declared("DOCTEST_RATIO", 0.5, "A share.", minimum=0, maximum=1)
>>> Example().port
0
>>> read_settings(Example, {"DOCTEST_RATIO": "0.25"})
Example(port=0, ratio=0.25)
>>> read_settings(Example, {"DOCTEST_PORT": "-1"})
Traceback (most recent call last):
...
freshcore.declare.SettingsError: DOCTEST_PORT=-1 must be >= 0
"""

from __future__ import annotations

import dataclasses
import math
import sys
import typing
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from schemas.errors import FreshRecError

SETTING = "freshrec.setting"
"""The key of a declared field's metadata that holds its ``Setting``."""

_REGISTRY: dict[str, Setting] = {}


class SettingsError(FreshRecError, ValueError):
    """A setting is missing or malformed; the message names the variable."""


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True, eq=False)
class Setting:
    """One environment variable: what it sets and what it accepts.

    ``kind`` is how its text is read: ``int``, ``float``, ``bool`` (true/false, 1/0, yes/no,
    on/off), ``str`` or ``Path``; ``choices`` limits a text to a few values; ``parse``
    reads a structured value (a list, a map) and raises ``ValueError`` with the reason.
    ``optional``: unset means None (a default decided elsewhere, which ``shown`` names).
    ``modes``: a serving mode may set it (``inference/serving/modes.py``)."""

    env: str
    default: Any
    doc: str
    kind: type = str
    minimum: float | None = None
    maximum: float | None = None
    positive: bool = False
    choices: tuple[str, ...] = ()
    parse: Callable[[str], Any] | None = None
    optional: bool = False
    modes: bool = False
    shown: str | None = None
    """How the docs show the default, where the value is not the whole story (a default
    taken from the models' manifest, the host's name)."""
    group: str = ""
    """The section of the settings reference it belongs to (empty: its module's)."""
    module: str = ""
    """The module that declares it."""

    def __post_init__(self) -> None:
        if not self.module:
            object.__setattr__(self, "module", _caller_module())
        if self.env in _REGISTRY and _REGISTRY[self.env].module != self.module:
            raise RuntimeError(
                f"{self.env} is declared twice: in {_REGISTRY[self.env].module} and {self.module}"
            )
        _REGISTRY[self.env] = self

    def read(self, env: Mapping[str, str], default: Any = dataclasses.MISSING) -> Any:
        """The value ``env`` gives, checked; unset or empty: ``default`` (the declared one
        unless the caller knows better, e.g. from the models' manifest)."""
        raw = env.get(self.env)
        fallback = self.default if default is dataclasses.MISSING else default
        if raw is None or raw == "":
            return fallback
        return self.convert(raw)

    def convert(self, raw: str) -> Any:
        """``raw`` read as this setting's kind and checked against its bounds."""
        if self.parse is not None:
            try:
                return self.parse(raw)
            except ValueError as exc:
                raise SettingsError(f"{self.env}={raw!r}: {exc}") from None
        if self.choices:
            value = raw.strip()
            if value not in self.choices:
                raise SettingsError(f"{self.env}={raw!r} must be one of {', '.join(self.choices)}")
            return value
        if self.kind is bool:
            return _boolean(self.env, raw)
        if self.kind in (int, float):
            return self._check(_number(self.env, raw, self.kind))
        return Path(raw) if self.kind is Path else raw

    def _check(self, value: float) -> float:
        shown = f"{value:g}" if isinstance(value, float) else str(value)
        if self.positive and value <= 0:
            raise SettingsError(f"{self.env}={shown} must be > 0")
        if self.minimum is not None and value < self.minimum:
            raise SettingsError(f"{self.env}={shown} must be >= {self.minimum:g}")
        if self.maximum is not None and value > self.maximum:
            raise SettingsError(f"{self.env}={shown} must be <= {self.maximum:g}")
        return value

    def default_text(self) -> str:
        """The default as the docs show it."""
        if self.shown is not None:
            return self.shown
        value = self.default
        if value is None or value == "":
            return "unset"
        if isinstance(value, bool):
            return "true" if value else "false"
        if isinstance(value, int):
            return f"{value:,}"
        if isinstance(value, float):
            return f"{value:,g}" if abs(value) >= 1000 else f"{value:g}"
        return str(value)

    def accepts(self) -> str:
        """What the setting accepts, as the docs show it."""
        if self.choices:
            return ", ".join(self.choices)
        if self.kind is bool:
            return "true / false"
        if self.kind in (int, float):
            bounds = []
            if self.positive:
                bounds.append("> 0")
            if self.minimum is not None:
                bounds.append(f"≥ {self.minimum:g}")
            if self.maximum is not None:
                bounds.append(f"≤ {self.maximum:g}")
            kind = "integer" if self.kind is int else "number"
            return f"{kind} {', '.join(bounds)}".strip()
        return "path" if self.kind is Path else "text"


def declared(
    env: str,
    default: Any,
    doc: str,
    *,
    kind: type | None = None,
    factory: Callable[[], Any] | None = None,
    repr: bool = True,
    **options: Any,
) -> Any:
    """A dataclass field that is the declaration of ``env``: its default is ``default``
    (or ``factory()`` for a mutable value; ``default`` is then what the docs show), its
    kind is ``kind`` or the default's type; ``repr=False`` keeps a secret out of reprs."""
    setting = Setting(
        env,
        default,
        doc,
        kind=kind or _kind_of(default),
        module=_caller_module(),
        **options,
    )
    if factory is not None:
        return field(default_factory=factory, repr=repr, metadata={SETTING: setting})
    return field(default=default, repr=repr, metadata={SETTING: setting})


def declared_as(setting: Setting) -> Any:
    """A dataclass field for a setting declared once elsewhere, because several services'
    settings hold it (the row TTL, the metrics port)."""
    return field(default=setting.default, metadata={SETTING: setting})


def setting_of(f: dataclasses.Field) -> Setting | None:
    return f.metadata.get(SETTING)


def declaration(cls: type, name: str) -> Setting:
    """The setting that field ``name`` of ``cls`` declares, to read it where no settings
    object is built (``declaration(ConnectionSettings, "redis_url").read(env, None)``)."""
    found = setting_of(next(f for f in dataclasses.fields(cls) if f.name == name))
    if found is None:
        raise KeyError(f"{cls.__name__}.{name} declares no setting")
    return found


def read_settings(cls: type, env: Mapping[str, str], /, **given: Any) -> Any:
    """``cls`` built from ``env``: each declared field read from its variable, each field that
    is itself a settings dataclass built the same way, ``given`` values as they are, the
    rest at their defaults."""
    hints = typing.get_type_hints(cls)
    values = {}
    for f in dataclasses.fields(cls):
        if f.name in given:
            values[f.name] = given[f.name]
            continue
        setting = setting_of(f)
        if setting is not None:
            if f.default is dataclasses.MISSING and not env.get(setting.env):
                continue  # unset: the field's factory makes a fresh default
            values[f.name] = setting.read(env)
        elif _is_settings_class(hints.get(f.name)):
            values[f.name] = read_settings(hints[f.name], env)
    unknown = set(given) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
        raise TypeError(f"{cls.__name__} has no field {sorted(unknown)}")
    return cls(**values)


def settings_in(cls: type) -> Iterator[Setting]:
    """Every setting ``cls`` declares, its nested settings dataclasses' included."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        setting = setting_of(f)
        if setting is not None:
            yield setting
        elif _is_settings_class(hints.get(f.name)):
            yield from settings_in(hints[f.name])


def mode_settings(cls: type) -> frozenset[str]:
    """The variables of ``cls``'s settings that a serving mode may set."""
    return frozenset(s.env for s in settings_in(cls) if s.modes)


def registry() -> dict[str, Setting]:
    """Every setting declared by the modules imported so far, by variable."""
    return dict(_REGISTRY)


def _is_settings_class(hint: Any) -> bool:
    return isinstance(hint, type) and dataclasses.is_dataclass(hint)


def _kind_of(default: Any) -> type:
    if isinstance(default, bool):
        return bool
    for kind in (int, float, Path):
        if isinstance(default, kind):
            return kind
    return str


def _caller_module() -> str:
    frame = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__") == __name__:
        frame = frame.f_back
    return frame.f_globals.get("__name__", "") if frame is not None else ""


def _boolean(name: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise SettingsError(f"{name}={raw!r} is not true or false")


def _number(name: str, raw: str, kind: type) -> float:
    try:
        value = kind(raw)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise SettingsError(f"{name}={raw!r} is not {what}") from None
    if kind is float and not math.isfinite(value):
        raise SettingsError(f"{name}={raw!r} is not a finite number")
    return value
