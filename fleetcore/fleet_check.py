"""Every problem of a fleet file at once, each with its YAML line and a "did you mean" where one fits.

`load_fleet_file` stops at the first failing stage with one error text; `tokenfleet check`
wants a list an operator can fix in one pass:

- YAML syntax errors, at the line the parser names;
- schema errors (pydantic collects every field error): located by their path
  (`deployments.2.gpu`), an unknown field with the closest allowed name, a wrong choice
  (`adapter: simm`) with the closest allowed value;
- cross-field errors (unknown sites, models, aliases, cycles...; `FleetConfig._validate`
  reports them all), located by the entry they name.

Pure: text in, problems out.
"""

from __future__ import annotations

import re
import types
import typing
from dataclasses import dataclass
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from fleetcore.fleet_config import FleetConfig, did_you_mean

Path = tuple[str | int, ...]


@dataclass(frozen=True, slots=True)
class Problem:
    line: int | None  # 1-based; None when it cannot be placed
    where: str  # dotted path, or "(top level)"
    message: str

    def format(self, source: str) -> str:
        at = f"{source}:{self.line}" if self.line is not None else source
        return f"{at}: {self.where}: {self.message}"


def line_map(text: str) -> dict[Path, int]:
    """Path -> 1-based line of the key (mappings) or item (sequences) in the YAML text."""
    out: dict[Path, int] = {}
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return out

    def walk(node: yaml.Node, path: Path) -> None:
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                p = (*path, str(key.value))
                out[p] = key.start_mark.line + 1
                walk(value, p)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                p = (*path, i)
                out[p] = item.start_mark.line + 1
                walk(item, p)

    if root is not None:
        out[()] = root.start_mark.line + 1
        walk(root, ())
    return out


def _line(lines: dict[Path, int], path: Path) -> int | None:
    """The line of `path`, or of its nearest ancestor present in the file."""
    for n in range(len(path), -1, -1):
        if path[:n] in lines:
            return lines[path[:n]]
    return None


def _model_in(annotation: Any) -> tuple[type[BaseModel] | None, bool]:
    """(the pydantic model inside an annotation, whether a dict key comes first on the way)."""
    origin = typing.get_origin(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, False
    args = typing.get_args(annotation)
    if origin is dict:
        inner, _ = _model_in(args[1]) if len(args) == 2 else (None, False)
        return inner, True
    if origin in (list, tuple, typing.Union, types.UnionType):
        for a in args:
            inner, keyed = _model_in(a)
            if inner is not None:
                return inner, keyed
    return None, False


def allowed_fields(path: Path, root: type[BaseModel] = FleetConfig) -> list[str]:
    """Field names the schema allows at `path` (the mapping holding a field), [] if unknown."""
    model: type[BaseModel] | None = root
    skip_key = False
    for part in path:
        if model is None:
            return []
        if isinstance(part, int):
            continue
        if skip_key:
            skip_key = False
            continue
        field = model.model_fields.get(part)
        if field is None:
            return []
        model, skip_key = _model_in(field.annotation)
    return list(model.model_fields) if model is not None and not skip_key else []


def _schema_problem(e: Any, lines: dict[Path, int]) -> Problem:
    path: Path = tuple(e["loc"])
    where = ".".join(str(p) for p in path) or "(top level)"
    msg = e["msg"]
    if e["type"] == "extra_forbidden" and path:
        msg = f"unknown field {path[-1]!r}" + did_you_mean(str(path[-1]), allowed_fields(path[:-1]))
    elif e["type"] == "literal_error" and isinstance(e.get("input"), str):
        options = re.findall(r"'([^']*)'", str((e.get("ctx") or {}).get("expected", "")))
        msg += did_you_mean(e["input"], options)
    return Problem(_line(lines, path), where, msg)


_INDEXED = re.compile(r"^(\w+)\[(\d+)\]")
_INDEXED_PREFIX = re.compile(r"^(\w+\[\d+\]|aliases): ")
_NAMED = {"site": "sites", "model": "models", "tenant": "tenants"}


def _locate(message: str, data: dict[str, Any]) -> Path:
    """Where a cross-field message points: `deployments[2]: ...`, `site 'x': ...`, `aliases: 'x' ...`."""
    if m := _INDEXED.match(message):
        return (m.group(1), int(m.group(2)))
    if m := re.match(r"^(site|model|tenant) '([^']*)'", message):
        section = _NAMED[m.group(1)]
        for i, item in enumerate(data.get(section) or []):
            if isinstance(item, dict) and item.get("name") == m.group(2):
                return (section, i)
        return (section,)
    if m := re.match(r"^aliases: (?:cycle )?'?([^' ]+)", message):
        return ("aliases", m.group(1))
    head = re.match(r"^(\w+)", message)
    return (head.group(1),) if head and head.group(1) in FleetConfig.model_fields else ()


def check_fleet_text(text: str) -> tuple[FleetConfig | None, list[Problem]]:
    """The config when it is valid, and every problem found."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        return None, [Problem(mark.line + 1 if mark is not None else None, "(yaml)",
                              f"not valid YAML: {getattr(e, 'problem', None) or e}")]
    if not isinstance(data, dict):
        return None, [Problem(1, "(top level)", "the fleet file must be a mapping at top level")]
    lines = line_map(text)
    try:
        return FleetConfig.model_validate(data), []
    except ValidationError as err:
        problems: list[Problem] = []
        for e in err.errors():
            if e["loc"] == () and e["type"] == "value_error":
                for msg in e["msg"].removeprefix("Value error, ").split("\n"):
                    path = _locate(msg, data)
                    msg = _INDEXED_PREFIX.sub("", msg)  # the path column says it already
                    problems.append(Problem(_line(lines, path), ".".join(map(str, path)) or "(top level)", msg))
            else:
                problems.append(_schema_problem(e, lines))
        if not any(e["loc"] == () for e in err.errors()):
            # Field errors stop pydantic before the cross-field checks: run the name checks on the
            # raw data, so a typo in a field and an unknown site show up in the same pass.
            problems += _raw_reference_problems(data, lines)
        return None, sorted(problems, key=lambda p: (p.line is None, p.line or 0))


def _names(data: dict[str, Any], section: str) -> list[str]:
    items = data.get(section)
    return [str(i["name"]) for i in items if isinstance(i, dict) and "name" in i] if isinstance(items, list) else []


def _raw_reference_problems(data: dict[str, Any], lines: dict[Path, int]) -> list[Problem]:
    """Deployments naming unknown sites or models, on data that did not pass the schema."""
    out: list[Problem] = []
    sites, models = _names(data, "sites"), _names(data, "models")
    aliases = data.get("aliases") if isinstance(data.get("aliases"), dict) else {}
    deployments = data.get("deployments") if isinstance(data.get("deployments"), list) else []
    for i, d in enumerate(deployments):
        if not isinstance(d, dict):
            continue
        for key, known in (("site", sites), ("model", models)):
            v = d.get(key)
            if isinstance(v, str) and known and v not in known:
                path: Path = ("deployments", i, key)
                out.append(Problem(_line(lines, path), f"deployments.{i}.{key}",
                                   f"unknown {key} {v!r} (known: {sorted(known)})" + did_you_mean(v, known)))
    for alias, target in aliases.items():
        name = str(target).partition("@")[0]
        if models and name not in models and name not in aliases:
            out.append(Problem(_line(lines, ("aliases", str(alias))), f"aliases.{alias}",
                               f"{alias!r} -> unknown model {target!r}" + did_you_mean(name, models)))
    return out
