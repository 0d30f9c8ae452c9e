"""`dataclasses.replace` for the request path's own copies, without its per-call field walk.

`dataclasses.replace(obj, **changes)` walks the class's fields on every call (a dict lookup,
two attribute tests and a `getattr` per field), builds a keyword dict and calls `__init__`
with it. A request makes three such copies on its way (telemetry's record into the parsed
request; admission's class into the profile, and the profile into the parsed request): ~1,000
bytecodes a request, about 5% of all the gateway executes for it (bench/README.md, "Issue 14:
per layer"). `replace` here does the same copy with a function made once per class and set of
changed names (and `fleetmind.place` its one copy of a decision with the site's round trip in its
TTFT; here in fleetcore, pure, so that policy layers can use it too): the new object, then each field set as the class's own `__init__` sets it
(`object.__setattr__`, frozen or not), the changed ones from `changes`, the rest from `obj`.

Only where that is all `replace` would do: a dataclass whose fields are all `init` fields and
that has no `__post_init__` (nor `InitVar`s: `replace` demands them). Anything else, and
any name that is not a field (`replace` raises TypeError for it), goes to
`dataclasses.replace` itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

_COPIERS: dict[tuple[type, tuple[str, ...]], Callable[..., Any] | None] = {}


def replace(obj: T, /, **changes: Any) -> T:
    """`dataclasses.replace(obj, **changes)`, the same object made more cheaply (module docstring)."""
    key = (type(obj), tuple(changes))
    copier = _COPIERS.get(key)
    if copier is None:
        if key in _COPIERS:  # not eligible: the standard way
            return dataclasses.replace(obj, **changes)  # type: ignore[type-var]
        copier = _COPIERS[key] = _copier(*key)
        if copier is None:
            return dataclasses.replace(obj, **changes)  # type: ignore[type-var]
    return copier(obj, *changes.values())  # type: ignore[no-any-return]


def _copier(cls: type, names: tuple[str, ...]) -> Callable[..., Any] | None:
    """`(obj, *new values of names) -> copy`, or None where `dataclasses.replace` must do it."""
    if not dataclasses.is_dataclass(cls) or hasattr(cls, "__post_init__") or cls.__new__ is not object.__new__:
        return None
    if not cls.__dataclass_params__.frozen and cls.__setattr__ is not object.__setattr__:  # type: ignore[attr-defined]
        return None  # its __init__ would go through that __setattr__
    all_fields = cls.__dataclass_fields__  # type: ignore[attr-defined]
    fields = dataclasses.fields(cls)  # the real fields (no ClassVar, no InitVar)
    if len(fields) != len(all_fields) or not all(f.init for f in fields):
        return None  # InitVars, or fields outside __init__: as replace
    field_names = {f.name for f in fields}
    if not set(names) <= field_names or len(set(names)) != len(names):
        return None  # replace raises the TypeError
    params = [f"_v{i}" for i in range(len(names))]
    lines = [f"def copy(_o, {', '.join(params)}):" if params else "def copy(_o):", "    _n = _new(_cls)"]
    for f in fields:
        value = params[names.index(f.name)] if f.name in names else f"_o.{f.name}"
        lines.append(f"    _set(_n, {f.name!r}, {value})")
    lines.append("    return _n")
    scope: dict[str, Any] = {"_new": object.__new__, "_set": object.__setattr__, "_cls": cls}
    exec("\n".join(lines), scope)  # noqa: S102  (names are a dataclass's own identifiers)
    return scope["copy"]  # type: ignore[no-any-return]
