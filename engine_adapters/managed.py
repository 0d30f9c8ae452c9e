"""Real engine servers (vLLM, SGLang): launch one process per instance, or attach to running ones.

What the vLLM and SGLang adapters share: free ports, one log file per engine,
readiness by polling `GET /health` while watching the process, graceful stop
(SIGTERM, SIGKILL of the whole process group after a grace period), and the
KV event subscriber (`kv_zmq`) that the engines publish to. Subclasses only say
how to spell the command line (`engine_argv`) and the environment.

Launch mode (`options.model`): the adapter starts the engines; the gateway's
stop stops them. Attach mode (`options.urls`): someone else runs the engines;
the adapter only watches them, and hears their KV events when each engine was
told to publish to `options.kv_events_bind` with the topic in `options.kv_topics`.

In launch mode the engines are supervised (`engine_adapters.supervise`): one that exits
is started again on its port with backoff; the gateway's poller admits it once it has
loaded. Attached engines are never restarted: they are someone else's.
"""

from __future__ import annotations

from fleetcore.types import Role

import abc
import asyncio
import logging
import os
import re
import socket
import sys
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from engine_adapters.base import AdapterError, Instance, KVEventBatch
from engine_adapters.http_engine import HttpEngineAdapter
from engine_adapters.kv_translate import BlockHashTranslator
from engine_adapters.kv_zmq import KVEventSubscriber
from engine_adapters.process import exit_code_soon, kill_group, spawn, terminate
from engine_adapters.supervise import RestartPolicy, Supervisor
from fleetcore.fleet_config import EngineConfigSpec, FleetConfigError
from fleetcore.model_tokenizer import expand_path

log = logging.getLogger("tokenfleet.engines")

TOPIC_PREFIX = "tokenfleet/"
_LOG_TAIL_BYTES = 4000


class EngineOptions(BaseModel):
    """`options:` of a vllm/sglang deployment in the fleet file (unknown keys are errors)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str | None = Field(default=None, description="model directory or hub name; launch mode")
    tokenizer: str | None = Field(default=None, description="tokenizer directory, if not the model's")
    python: str = Field(default_factory=lambda: sys.executable,
                        description="interpreter of the environment the engine is installed in")
    host: str = "127.0.0.1"
    ports: list[int] | None = Field(default=None, description="fixed ports, one per instance")
    urls: list[str] = Field(default_factory=list, description="attach mode: running engines")
    kv_events: bool = True
    kv_events_bind: str = Field(default="tcp://127.0.0.1:*",
                                description="where the gateway's ZMQ subscriber binds")
    kv_events_endpoint: str | None = Field(default=None,
                                           description="address engines connect to, if not the bound one")
    kv_topics: list[str] = Field(default_factory=list, description="attach mode: topic per url")
    extra_args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    ready_timeout_s: float = Field(default=900.0, gt=0)
    stop_grace_s: float = Field(default=20.0, ge=0)
    log_dir: str | None = None

    @model_validator(mode="after")
    def _mode(self) -> EngineOptions:
        if bool(self.model) == bool(self.urls):
            raise ValueError("give either `model` (launch engines) or `urls` (attach to running ones)")
        if self.kv_topics and len(self.kv_topics) != len(self.urls):
            raise ValueError(f"kv_topics has {len(self.kv_topics)} entries for {len(self.urls)} urls")
        return self

    @classmethod
    def parse(cls, options: dict[str, Any], where: str) -> Any:
        try:
            return cls.model_validate(options)
        except ValidationError as e:
            msgs = "; ".join(f"{'.'.join(str(p) for p in err['loc']) or 'options'}: "
                             f"{err['msg'].removeprefix('Value error, ')}" for err in e.errors())
            raise FleetConfigError(f"deployment {where}: options: {msgs}") from None


def free_ports(n: int, host: str) -> list[int]:
    """n distinct free ports; all held open together so they cannot repeat."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)


def log_tail(path: Path | None, limit: int = _LOG_TAIL_BYTES) -> str:
    if path is None or not path.is_file():
        return ""
    with path.open("rb") as f:
        f.seek(max(0, path.stat().st_size - limit))
        return f.read().decode("utf-8", "replace")


class ManagedEngineAdapter(HttpEngineAdapter):
    """Base of the vLLM and SGLang adapters (see the module doc)."""

    name = "managed"
    options_class: type[EngineOptions] = EngineOptions

    def __init__(self, *, id_prefix: str, site: str, model: str, version: str, instances: int | None,
                 engine: EngineConfigSpec, gpu: str | None, tp: int, options: EngineOptions,
                 exact_kv: bool = True, restart: RestartPolicy | None = None,
                 roles: list[Role] | None = None) -> None:
        super().__init__()
        self.roles: list[Role] = list(roles or [])  # the fleet file's P/D role per instance index
        self.id_prefix, self.site, self.model, self.version = id_prefix, site, model, version
        self.engine, self.gpu, self.tp = engine, gpu, tp
        self.options = options
        self.attach = bool(options.urls)
        count = len(options.urls) if self.attach else (1 if instances is None else instances)
        if self.attach and instances is not None and instances != count:
            raise FleetConfigError(f"deployment {id_prefix}: instances={instances} but "
                                   f"{count} urls given")
        if options.ports is not None and len(options.ports) != count:
            raise FleetConfigError(f"deployment {id_prefix}: {len(options.ports)} ports for {count} instances")
        self.count = count
        # KV events feed the exact cache index only when the gateway hashes prompts with the
        # model's own tokenizer; otherwise their keys could never match (approximate mode).
        self.kv_enabled = options.kv_events and exact_kv and (not self.attach or bool(options.kv_topics))
        self.subscriber: KVEventSubscriber | None = None
        self._procs: dict[str, asyncio.subprocess.Process] = {}
        self._logs: dict[str, Path] = {}
        self._instances: list[Instance] = []
        self._next_index = count  # ids of instances added later never repeat a removed one's
        self.supervisor = Supervisor(id_prefix, restart or RestartPolicy(), self._respawn)

    # -- what subclasses say -------------------------------------------------
    @abc.abstractmethod
    def engine_argv(self, port: int, kv_events_config: dict[str, Any] | None, index: int = 0) -> list[str]:
        """The command line of engine `index` (after the interpreter)."""

    # -- P/D disaggregation (issue 17) ---------------------------------------
    pd_protocol = "sglang"  # what the gateway's P/D flow speaks to this engine (gateway.pd_flow)

    def role_of(self, index: int) -> Role:
        return self.roles[index] if index < len(self.roles) else "mixed"

    def bootstrap_port(self, index: int) -> int | None:
        """Where a decode leg reaches prefill instance `index` (None: not a prefill instance)."""
        return None

    @property
    def runs_pd(self) -> bool:
        """Whether this deployment runs prefill/decode (the fleet file gives it non-mixed roles)."""
        return any(r != "mixed" for r in self.roles)

    @property
    def step_budget(self) -> int:
        """The engines' per-step token budget (vLLM `--max-num-batched-tokens`, SGLang
        `--chunked-prefill-size`): the P/D budget where the deployment runs P/D
        (`EngineConfigSpec.step_budget`, which the sim adapter's workers launch at too)."""
        return self.engine.step_budget(self.roles)

    def instance_env(self, index: int) -> dict[str, str]:
        """Environment of engine `index` on top of `engine_env` (per-instance P/D ports)."""
        return {}

    def engine_env(self) -> dict[str, str]:
        """Environment of the engines on top of the gateway's own."""
        return dict(self.options.env)

    def kv_events_config(self, endpoint: str, topic: str) -> dict[str, Any]:
        return {"publisher": "zmq", "endpoint": endpoint, "topic": topic}

    # -- lifecycle --------------------------------------------------------------
    @property
    def instances(self) -> list[Instance]:
        return list(self._instances)

    def process(self, instance: Instance) -> asyncio.subprocess.Process | None:
        return self._procs.get(instance.instance_id)

    def log_path(self, instance: Instance) -> Path | None:
        return self._logs.get(instance.instance_id)

    def _instance(self, index: int, url: str) -> Instance:
        eng = self.engine
        pd = self.runs_pd
        return Instance(instance_id=f"{self.id_prefix}/{index}", site=self.site, model=self.model,
                        version=self.version, url=url.rstrip("/"), adapter=self.name,
                        block_size=eng.block_size, max_model_len=eng.max_model_len,
                        engine_spec=eng.spec, gpu=self.gpu, tp=self.tp,
                        max_batched_tokens=self.step_budget, role=self.role_of(index),
                        pd_protocol=self.pd_protocol if pd else None, bootstrap_port=self.bootstrap_port(index))

    def _start_subscriber(self) -> KVEventSubscriber:
        sub = KVEventSubscriber(self.options.kv_events_bind, self.options.kv_events_endpoint)
        try:
            sub.start()
        except OSError as e:
            raise AdapterError(f"{self.id_prefix}: {e}") from None
        self.subscriber = sub
        return sub

    async def launch(self) -> list[Instance]:
        if self.attach:
            return await self._attach()
        sub = self._start_subscriber() if self.kv_enabled else None
        ports = self.options.ports or free_ports(self.count, self.options.host)
        results = await asyncio.gather(*(self._launch_one(i, ports[i], sub) for i in range(self.count)),
                                       return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await self.stop()
            first = errors[0]
            raise first if isinstance(first, AdapterError) else AdapterError(f"{self.id_prefix}: {first}")
        self._instances = [r for r in results if isinstance(r, Instance)]
        for inst in self._instances:
            self.supervisor.watch(inst.instance_id, self._procs[inst.instance_id])
        return self.instances

    async def _attach(self) -> list[Instance]:
        # Like the static adapter: an engine that is down now joins when it answers health.
        sub = self._start_subscriber() if self.kv_enabled else None
        self._instances = [self._instance(i, url) for i, url in enumerate(self.options.urls)]
        if sub is not None:
            for inst, topic in zip(self._instances, self.options.kv_topics, strict=True):
                sub.register(topic, inst.instance_id, self.engine.block_size)
        return self.instances

    async def _launch_one(self, index: int, port: int, sub: KVEventSubscriber | None) -> Instance:
        inst, proc, log_path = await self._spawn_one(index, port, sub)
        await self._wait_ready(inst, proc, log_path)
        return inst

    async def _spawn_one(self, index: int, port: int, sub: KVEventSubscriber | None,
                         ) -> tuple[Instance, asyncio.subprocess.Process, Path]:
        host = self.options.host
        shown = f"[{host}]" if ":" in host else host
        inst = self._instance(index, f"http://{shown}:{port}")
        kv_config = None
        if sub is not None:
            topic = TOPIC_PREFIX + inst.instance_id
            if sub.has(inst.instance_id):  # a restart: same channel (its reader follows it), cold map
                sub.reset(inst.instance_id)
            else:
                sub.register(topic, inst.instance_id, self.engine.block_size)
            kv_config = self.kv_events_config(sub.endpoint, topic)
        argv = [str(expand_path(self.options.python)), *self.engine_argv(port, kv_config, index)]
        log_path = self._log_dir() / f"{_safe(inst.instance_id)}.log"
        self._logs[inst.instance_id] = log_path
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.engine_env(), **self.instance_env(index)}
        with log_path.open("ab") as logf:
            logf.write(f"tokenfleet: {' '.join(argv)}\n".encode())
            logf.flush()
            try:
                proc = await spawn(argv, env=env, stdout=logf, stderr=asyncio.subprocess.STDOUT,
                                   own_group=True)
            except OSError as e:
                raise AdapterError(f"{inst.instance_id}: cannot start {argv[0]}: {e.strerror}") from None
        self._procs[inst.instance_id] = proc
        return inst, proc, log_path

    # -- scaling (FleetMind's planner) ------------------------------------------------
    @property
    def scalable(self) -> bool:
        # Attached engines belong to someone else; fixed ports leave no room for another.
        return not self.attach and self.options.ports is None

    async def add_instance(self) -> Instance:
        """Start one more engine; it is returned at once and answers health once it has loaded
        (the gateway's poller brings it into routing then)."""
        if not self.scalable:
            raise AdapterError(f"{self.id_prefix}: attached engines or fixed ports cannot be scaled")
        index, self._next_index = self._next_index, self._next_index + 1
        inst, proc, _ = await self._spawn_one(index, free_ports(1, self.options.host)[0], self.subscriber)
        self._instances.append(inst)
        self.supervisor.watch(inst.instance_id, proc)
        return inst

    async def remove_instance(self, instance: Instance) -> None:
        await self.supervisor.release(instance.instance_id)  # a planned stop, not a crash
        self._instances = [i for i in self._instances if i.instance_id != instance.instance_id]
        proc = self._procs.pop(instance.instance_id, None)
        if proc is not None:
            await terminate([proc], self.options.stop_grace_s, groups=True)
        if self.subscriber is not None:
            self.subscriber.unregister(instance.instance_id)  # its hash map and buffer go with it

    def _log_dir(self) -> Path:
        if self.options.log_dir:
            d = expand_path(self.options.log_dir)
        else:
            d = Path(tempfile.gettempdir()) / f"tokenfleet-engines-{os.getpid()}"
        d.mkdir(parents=True, exist_ok=True)
        return d

    async def _wait_ready(self, inst: Instance, proc: asyncio.subprocess.Process, log_path: Path) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.options.ready_timeout_s
        while loop.time() < deadline:
            if proc.returncode is not None or await exit_code_soon(proc, 0.5) is not None:
                raise AdapterError(f"{inst.instance_id}: engine exited with code {proc.returncode} "
                                   f"before it was ready; log {log_path}:\n{log_tail(log_path)}")
            if await self.health(inst):
                log.info("%s ready at %s (log %s)", inst.instance_id, inst.url, log_path)
                return
        raise AdapterError(f"{inst.instance_id}: not ready after {self.options.ready_timeout_s:.0f} s; "
                           f"log {log_path}:\n{log_tail(log_path)}")

    # -- supervision -------------------------------------------------------------
    def down(self, instance: Instance) -> bool:
        return self.supervisor.down(instance.instance_id)

    def restart_counts(self) -> dict[str, int]:
        return dict(self.supervisor.restarts)

    async def _respawn(self, instance_id: str) -> asyncio.subprocess.Process:
        """Start a dead engine again on its port; it loads while the poller waits for its health."""
        old = next((i for i in self._instances if i.instance_id == instance_id), None)
        if old is None:
            raise LookupError(f"{instance_id} is no longer part of the deployment")
        index = int(instance_id.rsplit("/", 1)[1])
        port = int(old.url.rsplit(":", 1)[1])
        dead = self._procs.get(instance_id)
        if dead is not None:
            kill_group(dead)  # helpers of the dead leader may still hold the GPU or the port
        _, proc, _ = await self._spawn_one(index, port, self.subscriber)
        return proc

    async def stop(self) -> None:
        await self.supervisor.close()  # first: the stops below are not crashes
        procs = list(self._procs.values())
        if procs:
            await terminate(procs, self.options.stop_grace_s, groups=True)
        self._procs.clear()
        if self.subscriber is not None:
            await self.subscriber.close()
            self.subscriber = None
        await self.close_http()

    # -- KV events ----------------------------------------------------------------
    def kv_events(self, instance: Instance) -> AsyncIterator[KVEventBatch] | None:
        sub = self.subscriber
        if sub is None or not sub.has(instance.instance_id):
            return None
        return sub.stream(instance.instance_id)

    def kv_event_drops(self) -> dict[tuple[str, str], int]:
        return self.subscriber.drops() if self.subscriber is not None else {}

    def kv_translator(self, instance: Instance) -> BlockHashTranslator | None:
        """The engine-hash -> index-key map of one instance (diagnostics, tests)."""
        return self.subscriber.translator(instance.instance_id) if self.subscriber else None

