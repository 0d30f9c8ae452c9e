"""The canonical request trace: one arrival per row, prefix blocks named by id.

JSON lines, one request per line (the Mooncake layout plus optional keys):

    {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, 2],
     "tenant": "acme", "class": "interactive", "region": "eu", "model": "m",
     "session": "chat-1-4", "deadline_s": 600.0, "block_tokens": 512}

`timestamp` is milliseconds from the trace start; `hash_ids` name the prompt's
prefix blocks of `block_tokens` tokens each (equal leading ids = shared prefix).

Block size: 512 tokens unless overridden. The override is either
  * a header line, only as the first non-blank line: an object with no
    `input_length`, e.g. `{"block_tokens": 16, "name": "x", "metadata": {...}}`,
    which sets the file's default (and the workload's name and metadata), or
  * a `block_tokens` key on a row, which wins for that row only.
"""

from __future__ import annotations

import gzip
import json
import math
import statistics
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xxhash

DEFAULT_BLOCK_TOKENS = 512

# Generated and converted block ids live in their own namespace above 2**40 so
# they never collide with trace ids (Mooncake's are below 2**18) or each other.
ID_NAMESPACE_SHIFT = 40


def id_namespace(tag: str) -> int:
    """First block id of the namespace named `tag`: a multiple of 2**40, below 2**63."""
    slot = xxhash.xxh64_intdigest(tag.encode("utf-8")) % ((1 << 22) - 1) + 1
    return slot << ID_NAMESPACE_SHIFT


@dataclass(frozen=True, slots=True)
class TraceRequest:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    block_tokens: int = DEFAULT_BLOCK_TOKENS
    tenant: str | None = None
    request_class: str | None = None  # JSON key "class"
    region: str | None = None
    model: str | None = None
    session: str | None = None
    deadline_s: float | None = None

    @property
    def arrival_s(self) -> float:
        return self.timestamp_ms / 1000.0

    def to_json_dict(self, default_block_tokens: int = DEFAULT_BLOCK_TOKENS) -> dict[str, Any]:
        ts: float | int = self.timestamp_ms
        if float(ts).is_integer():
            ts = int(ts)  # keeps files byte-compatible with Mooncake's integer timestamps
        d: dict[str, Any] = {"timestamp": ts, "input_length": self.input_length,
                             "output_length": self.output_length, "hash_ids": list(self.hash_ids)}
        if self.block_tokens != default_block_tokens:
            d["block_tokens"] = self.block_tokens
        for key, val in (("tenant", self.tenant), ("class", self.request_class),
                         ("region", self.region), ("model", self.model),
                         ("session", self.session), ("deadline_s", self.deadline_s)):
            if val is not None:
                d[key] = val
        return d


@dataclass(slots=True)
class Workload:
    """A named, time-ordered list of requests. Treat it as immutable: `mix` returns new ones."""

    name: str
    requests: list[TraceRequest]
    block_tokens: int = DEFAULT_BLOCK_TOKENS
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        reqs = self.requests
        if any(reqs[i].timestamp_ms > reqs[i + 1].timestamp_ms for i in range(len(reqs) - 1)):
            # Stable: requests at one instant keep their given order.
            self.requests = sorted(reqs, key=lambda r: r.timestamp_ms)
        else:
            self.requests = list(reqs)

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[TraceRequest]:
        return iter(self.requests)

    @property
    def duration_s(self) -> float:
        if not self.requests:
            return 0.0
        return (self.requests[-1].timestamp_ms - self.requests[0].timestamp_ms) / 1000.0

    @property
    def mean_rate(self) -> float:
        """Requests per second over the span; 0.0 when every request arrives at one instant."""
        d = self.duration_s
        return len(self.requests) / d if d > 0 else 0.0

    def to_jsonl(self, path: str | Path, header: bool = True) -> None:
        """Write canonical JSON lines (gzip when the name ends in .gz).

        With `header` the first line carries name, block_tokens and metadata;
        without it the file is plain Mooncake rows (block_tokens per row if not 512).
        """
        p = Path(path)
        default_bt = self.block_tokens if header else DEFAULT_BLOCK_TOKENS
        lines: list[str] = []
        if header:
            lines.append(json.dumps({"name": self.name, "block_tokens": self.block_tokens,
                                     "metadata": self.metadata}, default=str))
        lines.extend(json.dumps(r.to_json_dict(default_bt)) for r in self.requests)
        data = "\n".join(lines) + "\n"
        if p.name.endswith(".gz"):
            with gzip.open(p, "wt", encoding="utf-8") as f:
                f.write(data)
        else:
            p.write_text(data, encoding="utf-8")

    @classmethod
    def from_jsonl(cls, path: str | Path, *, id_offset: int = 0) -> Workload:
        return parse_jsonl(path, id_offset=id_offset)

    def describe(self) -> dict[str, Any]:
        """Summary statistics for the benchmark's `--json` "workload" section.

        Reuse metrics follow traces/SOURCES.md: file order is arrival order,
        the cache is infinite; prefix_repeat_frac counts only each request's leading
        run of already-seen ids (what a prefix cache can reuse).
        """
        reqs = self.requests
        n = len(reqs)
        ins = [r.input_length for r in reqs]
        outs = [r.output_length for r in reqs]
        seen: set[int] = set()
        refs = repeats = prefix_repeats = 0
        hit_tokens = 0
        for r in reqs:
            ids = r.hash_ids
            k = 0
            for h in ids:
                if h not in seen:
                    break
                k += 1
            prefix_repeats += k
            hit_tokens += min(k * r.block_tokens, r.input_length)
            for h in ids:
                if h in seen:
                    repeats += 1
                else:
                    seen.add(h)
            refs += len(ids)
        total_in = sum(ins)

        def frac(a: int, b: int) -> float:
            return round(a / b, 4) if b else 0.0

        def counts(values: Iterable[str | None]) -> dict[str, int]:
            return dict(sorted(Counter(v for v in values if v is not None).items()))

        return {
            "name": self.name,
            "requests": n,
            "duration_s": round(self.duration_s, 3),
            "mean_rate_rps": round(self.mean_rate, 4),
            "input_mean": round(total_in / n, 1) if n else 0.0,
            "input_median": float(statistics.median(ins)) if n else 0.0,
            "input_max": max(ins) if n else 0,
            "output_mean": round(sum(outs) / n, 1) if n else 0.0,
            "output_median": float(statistics.median(outs)) if n else 0.0,
            "block_tokens": self.block_tokens,
            "block_refs": refs,
            "unique_blocks": len(seen),
            "repeat_frac": frac(repeats, refs),
            "prefix_repeat_frac": frac(prefix_repeats, refs),
            "token_prefix_hit": frac(hit_tokens, total_in),
            "classes": counts(r.request_class for r in reqs),
            "tenants": counts(r.tenant for r in reqs),
            "regions": counts(r.region for r in reqs),
            "metadata": self.metadata,
        }


# ---------------------------------------------------------------- parsing

_OPTIONAL_STR = (("tenant", "tenant"), ("class", "request_class"), ("region", "region"),
                 ("model", "model"), ("session", "session"))


def read_text(path: str | Path) -> str:
    """The whole file as text; gzip by magic bytes, so a misnamed .gz still loads."""
    p = Path(path)
    with open(p, "rb") as f:
        raw = f.read()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    return raw.decode("utf-8")


def _is_int(v: object) -> bool:
    return type(v) is int  # bool is an int subclass; a True length is a bug, not a 1


def _row(obj: Mapping[str, Any], default_bt: int, id_offset: int) -> TraceRequest:
    """One validated row; raises ValueError with a message that lacks only the location."""
    try:
        ts = obj["timestamp"]
        inp = obj["input_length"]
        out = obj["output_length"]
        ids = obj["hash_ids"]
    except KeyError as e:
        raise ValueError(f"missing key {e.args[0]!r}") from None
    if type(ts) not in (int, float) or not math.isfinite(ts):
        raise ValueError(f"timestamp must be a finite number, got {ts!r}")
    if not _is_int(inp) or inp < 0:
        raise ValueError(f"input_length must be a non-negative integer, got {inp!r}")
    if not _is_int(out) or out < 0:
        raise ValueError(f"output_length must be a non-negative integer, got {out!r}")
    if type(ids) is not list or not all(type(h) is int and h >= 0 for h in ids):
        raise ValueError("hash_ids must be a list of non-negative integers")
    bt = obj.get("block_tokens", default_bt)
    if not _is_int(bt) or bt <= 0:
        raise ValueError(f"block_tokens must be a positive integer, got {bt!r}")
    extra: dict[str, Any] = {}
    for key, attr in _OPTIONAL_STR:
        v = obj.get(key)
        if v is not None:
            if type(v) is not str:
                raise ValueError(f"{key} must be a string or null, got {v!r}")
            extra[attr] = v
    dl = obj.get("deadline_s")
    if dl is not None:
        if type(dl) not in (int, float) or not dl > 0:
            raise ValueError(f"deadline_s must be a positive number or null, got {dl!r}")
        extra["deadline_s"] = float(dl)
    hash_ids = tuple(h + id_offset for h in ids) if id_offset else tuple(ids)
    return TraceRequest(float(ts), inp, out, hash_ids, bt, **extra)


def parse_jsonl(path: str | Path, *, id_offset: int = 0, name: str | None = None,
                fmt: str = "canonical") -> Workload:
    """Mooncake / canonical JSON lines → Workload. Errors name the file and line.

    `id_offset` is added to every hash id, to merge traces whose ids would collide.
    """
    p = Path(path)
    text = read_text(p)
    loads = json.loads
    default_bt = DEFAULT_BLOCK_TOKENS
    wl_name = name or _stem(p)
    metadata: dict[str, Any] = {}
    requests: list[TraceRequest] = []
    first = True
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = loads(line)
            if type(obj) is not dict:
                raise ValueError("a row must be a JSON object")
            if first and "input_length" not in obj:
                bt = obj.get("block_tokens", DEFAULT_BLOCK_TOKENS)
                if not _is_int(bt) or bt <= 0:
                    raise ValueError(f"header block_tokens must be a positive integer, got {bt!r}")
                default_bt = bt
                if name is None and isinstance(obj.get("name"), str):
                    wl_name = obj["name"]
                if isinstance(obj.get("metadata"), dict):
                    metadata.update(obj["metadata"])
                first = False
                continue
            first = False
            requests.append(_row(obj, default_bt, id_offset))
        except ValueError as e:  # json.JSONDecodeError is a ValueError too
            raise ValueError(f"{p}:{lineno}: {e}") from None
    metadata.setdefault("source", str(p))
    metadata.setdefault("format", fmt)
    return Workload(wl_name, requests, default_bt, metadata)


def _stem(p: Path) -> str:
    name = p.name
    for suffix in (".gz", ".jsonl", ".json", ".csv"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    return name
