"""The one interface every engine adapter speaks: launch, stop, health, load snapshot, abort, KV events.

An adapter owns one deployment (site x model x version x N instances). The gateway
never cares which engine sits behind an instance; it only sees `Instance` records
and `LoadSnapshot`s, and speaks the OpenAI API to `Instance.url`.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fleetcore.types import Role


@dataclass(frozen=True, slots=True)
class Instance:
    instance_id: str
    site: str
    model: str  # the served model name the gateway sends upstream
    version: str
    url: str  # base URL, no trailing slash, e.g. http://127.0.0.1:8001
    adapter: str
    block_size: int = 16
    max_model_len: int = 8192
    # What the engine runs on, when the fleet file says: lets policies start from a
    # roofline prior instead of a guess (see tokenpilot.priors).
    engine_spec: str | None = None
    gpu: str | None = None
    tp: int = 1
    max_batched_tokens: int = 8192
    # Prefill/decode disaggregation (issue 17): the instance's role, and the P/D protocol its
    # engine speaks ("sglang": bootstrap fields, both legs at once; "vllm": kv_transfer_params,
    # prefill then decode). `bootstrap_port`: where a decode leg reaches this prefill instance
    # (SGLang's --disaggregation-bootstrap-port; vLLM's side channel).
    role: Role = "mixed"
    pd_protocol: str | None = None
    bootstrap_port: int | None = None


@dataclass(frozen=True, slots=True)
class LoadSnapshot:
    """An engine's load as last scraped (vLLM metric semantics)."""

    ready: bool
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    prefix_cache_queries: float = 0.0
    prefix_cache_hits: float = 0.0
    block_size: int | None = None
    extra: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class KVEventBatch:
    """Blocks an engine stored or dropped, in vLLM's KVEventBatch shape."""

    instance_id: str
    seq: int
    events: list[dict[str, Any]]


class EngineAdapter(abc.ABC):
    name: str

    @property
    @abc.abstractmethod
    def instances(self) -> list[Instance]:
        """Instances launched (or attached) so far."""

    @abc.abstractmethod
    async def launch(self) -> list[Instance]:
        """Start (or attach to) the deployment's instances; returns once they answer health."""

    @abc.abstractmethod
    async def stop(self) -> None:
        """Stop whatever this adapter started; attached engines are left running."""

    @abc.abstractmethod
    async def health(self, instance: Instance) -> bool: ...

    async def check(self, instance: Instance) -> bool:
        """`health` for the gateway's poller, which needs to tell a miss from a certain death:
        raise `EngineDown` when the engine is certainly not serving (connection refused,
        process gone); return False for a failed or slow answer (it may recover)."""
        return await self.health(instance)

    # -- supervision (adapters that launch their engines) ------------------------------
    def down(self, instance: Instance) -> bool:
        """True while the engine's process is known dead or being restarted."""
        return False

    def restart_counts(self) -> dict[str, int]:
        """Replacement processes started so far, per instance id (empty where nothing is supervised)."""
        return {}

    @abc.abstractmethod
    async def snapshot(self, instance: Instance) -> LoadSnapshot: ...

    async def abort(self, instance: Instance, request_id: str) -> bool:
        """Ask the engine to drop a request. Closing the upstream connection also aborts it."""
        return False

    def kv_events(self, instance: Instance) -> AsyncIterator[KVEventBatch] | None:
        """A stream of KV cache events, or None when the engine does not publish them."""
        return None

    def kv_event_drops(self) -> dict[tuple[str, str], int]:
        """KV events that never reached a stream, (instance id or "", reason) -> count so far."""
        return {}

    # -- scaling (FleetMind's planner) ---------------------------------------------
    @property
    def scalable(self) -> bool:
        """Whether `add_instance` / `remove_instance` work (they do where the adapter launches engines)."""
        return False

    async def add_instance(self) -> Instance:
        """Start one more instance of the deployment. Returns as soon as it is reachable; it may
        still be loading (unhealthy) for a while, and joins routing when its health says ready."""
        raise AdapterError(f"{self.name} adapter cannot add instances")

    async def remove_instance(self, instance: Instance) -> None:
        """Stop one instance (the caller has drained it) and forget it."""
        raise AdapterError(f"{self.name} adapter cannot remove instances")


class AdapterError(RuntimeError):
    """An engine could not be launched or reached."""


class EngineDown(AdapterError):
    """The engine is certainly not serving: its connection was refused or its process is gone."""
