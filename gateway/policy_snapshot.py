"""The last-known-good region policies on local disk: what a gateway restarts from.

One JSON file per policy lineage (a Redis URL and key prefix, or one fleet's in-process
store) under the state directory: the fleet file's `gateway.state_dir`, else
`$TOKENFLEET_STATE_DIR`, else `~/.local/state/tokenfleet`. Written atomically (temp
file, fsync, rename, fsync of the directory), so a crash leaves the old file or the new
one, never half of one. A file that cannot be read is reported and ignored: the gateway
then knows nothing and fails closed (`gateway.policy_sync`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from fleetcore.region_policy import RegionPolicy
from gateway.policy_store import AuditEntry, KnownState, Snapshot, now_unix

log = logging.getLogger("tokenfleet.gateway")

FORMAT = 1


def state_dir(configured: str | None) -> Path:
    return Path(configured or os.environ.get("TOKENFLEET_STATE_DIR") or "~/.local/state/tokenfleet").expanduser()


class SnapshotFile:
    def __init__(self, directory: Path, identity: str) -> None:
        self.identity = identity
        digest = hashlib.sha256(identity.encode()).hexdigest()[:16]
        self.path = directory / f"region-policies-{digest}.json"

    def read(self) -> KnownState | None:
        try:
            raw = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        except OSError as e:
            log.error("region policies: cannot read the snapshot %s (%s); starting without it", self.path, e)
            return None
        try:
            data = json.loads(raw)
            if data.get("format") != FORMAT or data.get("store") != self.identity:
                raise ValueError(f"format {data.get('format')!r} of store {data.get('store')!r}")
            snap = Snapshot(int(data["version"]), tuple(RegionPolicy.model_validate(p) for p in data["policies"]))
            audit = tuple(AuditEntry(**e) for e in data.get("audit", ()))
        except (ValueError, TypeError, KeyError, AttributeError, ValidationError) as e:
            log.error("region policies: the snapshot %s is unreadable (%s); starting without it", self.path,
                      str(e).splitlines()[0] if str(e) else type(e).__name__)
            return None
        return KnownState(snap, audit)

    def write(self, state: KnownState) -> None:
        """Atomically replace the file with `state` (raises OSError; callers log and retry)."""
        body: dict[str, Any] = {
            "format": FORMAT, "store": self.identity, "saved_at": now_unix(), "version": state.version,
            "policies": [p.model_dump(exclude_defaults=True) for p in state.snapshot.policies],
            "audit": [asdict(e) for e in state.audit]}
        write_atomic(self.path, json.dumps(body, indent=1))


def write_atomic(path: Path, text: str) -> None:
    """Replace `path` with `text` so that a crash leaves the old file or the new one, never a part
    (temp file, fsync, rename, fsync of the directory). Raises OSError."""
    directory = path.parent
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # the rename itself survives a power cut
    finally:
        os.close(dir_fd)

