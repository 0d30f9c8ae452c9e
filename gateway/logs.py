"""Logging of the gateway process: text (default) or JSON lines, and structured records.

Structured records (`tokenfleet.access`, one per request; `tokenfleet.audit`, admin changes)
carry their fields as `record.fields` (a dict). The text format writes them as logfmt
(`key=value`, values with spaces quoted) after the logger name; the JSON format merges them
into the line's object, so a log shipper indexes every field without parsing the message.

Stdlib only: the CLI configures logging before it imports anything heavy.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, Literal

LogFormat = Literal["text", "json"]
LOG_FORMATS: tuple[str, ...] = ("text", "json")


def logfmt(fields: Mapping[str, Any]) -> str:
    """`k=v k2="v 2"`; None is left out (a field that does not apply to this line)."""
    parts = []
    for k, v in fields.items():
        if v is None:
            continue
        if isinstance(v, bool):
            text = "true" if v else "false"
        elif isinstance(v, float):
            text = f"{v:.4g}"
        else:
            text = str(v)
            if not text or any(c in text for c in ' "=\n'):
                text = json.dumps(text)
        parts.append(f"{k}={text}")
    return " ".join(parts)


class Fields:
    """A record's message, rendered only if a handler actually writes the record."""

    __slots__ = ("fields",)

    def __init__(self, fields: Mapping[str, Any]) -> None:
        self.fields = fields

    def __str__(self) -> str:
        return logfmt(self.fields)


def emit(logger: logging.Logger, level: int, fields: Mapping[str, Any]) -> None:
    """One structured record; nothing is formatted when `level` is filtered out."""
    if logger.isEnabledFor(level):
        logger.log(level, Fields(fields), extra={"fields": fields})


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, then the record's fields (or its message)."""

    def format(self, record: logging.LogRecord) -> str:
        obj: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, tz=UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(), "logger": record.name}
        fields = getattr(record, "fields", None)
        if isinstance(fields, Mapping):
            obj.update((k, v) for k, v in fields.items() if v is not None)
        else:
            obj["message"] = record.getMessage()
        if record.exc_info:
            obj["exc"] = self.formatException(record.exc_info)
        return json.dumps(obj, default=str, separators=(",", ":"))


TEXT_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"


def configure_logging(level: str = "warning", fmt: str = "text") -> None:
    """Root logger at `level`, one stderr handler in `fmt` (replacing what was there)."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}; got {fmt!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level.upper())
