"""The sim adapter: runs bundled simulated workers as local processes, one per instance.

Options (the deployment's `options:` in the fleet file): `time_scale`,
`num_gpu_blocks_override`, `pd_protocol` (`sglang`, the default, or `vllm`: which P/D protocol the gateway speaks to
the deployment's `roles`; the workers understand both), `startup_s` (how long an instance added at run time — by
FleetMind's planner — loads before it is ready; the fleet's first instances are ready when
`launch` returns), `network_rtt_ms` (an emulated network to the site: every request
is served one round trip late) and `urls` (attach mode: workers someone else runs, one URL per
instance, e.g. `tokenfleet up --replicas` attaching each gateway replica to the workers it
launched once, or simulated workers in their own pods; the KV event stream still works, the
workers are neither launched, supervised, scaled nor stopped here).

Workers are supervised (`engine_adapters.supervise`): one that dies is started again on its
instance id and port, with an empty engine (a restarted engine has a cold cache), after a
backoff; `remove_instance` and `stop` are never taken for a crash.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from typing import Any

from fleetcore.fleet_config import did_you_mean
from engine_adapters.base import AdapterError, Instance, KVEventBatch
from engine_adapters.http_engine import HttpEngineAdapter, ndjson_kv_events
from engine_adapters.process import drain, exit_code_soon, spawn, terminate
from engine_adapters.supervise import RestartPolicy, Supervisor
from fleetcore.types import Role

READY_TIMEOUT_S = 30.0
STOP_GRACE_S = 5.0
SIM_OPTIONS = ("time_scale", "num_gpu_blocks_override", "startup_s", "network_rtt_ms", "urls", "pd_protocol")
PD_PROTOCOLS = ("sglang", "vllm")


class SimAdapter(HttpEngineAdapter):
    name = "sim"

    def __init__(self, *, id_prefix: str, site: str, model: str, version: str, instances: int,
                 spec: str, gpu: str, tp: int = 1, block_size: int = 16, max_model_len: int = 32768,
                 max_num_batched_tokens: int = 8192, max_num_seqs: int = 256,
                 gpu_memory_utilization: float = 0.9, options: dict[str, Any] | None = None,
                 host: str = "127.0.0.1", restart: RestartPolicy | None = None,
                 embedding_dim: int | None = None, roles: list[Role] | None = None,
                 kv_link: tuple[float, float] = (50.0, 0.01)) -> None:
        super().__init__()
        self.id_prefix, self.site, self.model, self.version = id_prefix, site, model, version
        self.count = instances
        self.block_size, self.max_model_len = block_size, max_model_len
        self.spec, self.gpu, self.tp, self.max_batched_tokens = spec, gpu, tp, max_num_batched_tokens
        self.host = host
        opts = dict(options or {})
        urls = opts.pop("urls", None)
        if urls is not None and (not isinstance(urls, list) or not all(isinstance(u, str) for u in urls)):
            raise AdapterError(f"{id_prefix}: sim option `urls` must be a list of URLs")
        self.attach_urls: list[str] = [u.rstrip("/") for u in urls or []]
        if self.attach_urls:
            if instances != len(self.attach_urls):
                raise AdapterError(f"{id_prefix}: instances={instances} but {len(self.attach_urls)} urls given")
        self._args = [
            "--served-model-name", model, "--spec", spec, "--gpu", gpu, "--tp", str(tp),
            "--block-size", str(block_size), "--max-model-len", str(max_model_len),
            "--max-num-batched-tokens", str(max_num_batched_tokens),
            "--max-num-seqs", str(max_num_seqs),
            "--time-scale", str(float(opts.pop("time_scale", 1.0))),
        ]
        if embedding_dim is not None:  # an embedding model: the worker serves /v1/embeddings only
            self._args += ["--embedding-dim", str(embedding_dim)]
        if "num_gpu_blocks_override" in opts:
            self._args += ["--num-gpu-blocks-override", str(int(opts.pop("num_gpu_blocks_override")))]
        rtt = float(opts.pop("network_rtt_ms", 0.0))
        self.startup_s = float(opts.pop("startup_s", 0.0))
        if rtt < 0 or self.startup_s < 0:
            raise AdapterError(f"{id_prefix}: network_rtt_ms and startup_s must be >= 0")
        if rtt:
            self._args += ["--network-rtt-ms", str(rtt)]
        self.roles: list[Role] = list(roles or [])
        protocol = str(opts.pop("pd_protocol", "sglang"))
        if protocol not in PD_PROTOCOLS:
            raise AdapterError(f"{id_prefix}: sim option `pd_protocol` must be one of {', '.join(PD_PROTOCOLS)}")
        self.pd_protocol = protocol
        if any(r != "mixed" for r in self.roles):  # the site's interconnect: what KV leaves a worker by
            self._args += ["--kv-link-gb-s", str(kv_link[0]), "--kv-link-latency-ms", str(kv_link[1])]
        if opts:
            raise AdapterError(f"{id_prefix}: unknown sim option(s) "
                               + ", ".join(f"{k!r}{did_you_mean(k, SIM_OPTIONS)}" for k in sorted(opts))
                               + f" (known: {', '.join(SIM_OPTIONS)})")
        self._gpu_util = gpu_memory_utilization
        self._procs: dict[str, asyncio.subprocess.Process] = {}
        self._instances: list[Instance] = []
        self._next_index = instances
        self.supervisor = Supervisor(id_prefix, restart or RestartPolicy(), self._respawn)

    @property
    def instances(self) -> list[Instance]:
        return list(self._instances)

    def process(self, instance: Instance) -> asyncio.subprocess.Process | None:
        return self._procs.get(instance.instance_id)

    @property
    def attached(self) -> bool:
        return bool(self.attach_urls)

    async def launch(self) -> list[Instance]:
        if self.attached:
            # Same ids as the launching side gave them (`prefix/i` in URL order), so every gateway
            # replica names an instance alike; one that is down now joins when it answers health.
            self._instances = [self._instance(f"{self.id_prefix}/{i}", url)
                               for i, url in enumerate(self.attach_urls)]
            return self.instances
        ids = [f"{self.id_prefix}/{i}" for i in range(self.count)]
        results = await asyncio.gather(*(self._launch_one(iid) for iid in ids),
                                       return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await self.stop()
            raise AdapterError(f"{self.id_prefix}: {errors[0]}")
        self._instances = [r for r in results if isinstance(r, Instance)]
        for inst in self._instances:
            self.supervisor.watch(inst.instance_id, self._procs[inst.instance_id])
        return self.instances

    @property
    def scalable(self) -> bool:
        return not self.attached  # attached workers belong to whoever launched them

    async def add_instance(self) -> Instance:
        if self.attached:
            raise AdapterError(f"{self.id_prefix}: attached workers cannot be scaled")
        iid = f"{self.id_prefix}/{self._next_index}"
        self._next_index += 1
        try:
            inst = await self._launch_one(iid, ["--startup-s", str(self.startup_s)])
        except BaseException:
            proc = self._procs.pop(iid, None)
            if proc is not None:
                await terminate([proc], STOP_GRACE_S)
            raise
        self._instances.append(inst)
        self.supervisor.watch(iid, self._procs[iid])
        return inst

    async def remove_instance(self, instance: Instance) -> None:
        await self.supervisor.release(instance.instance_id)  # a planned stop, not a crash
        self._instances = [i for i in self._instances if i.instance_id != instance.instance_id]
        proc = self._procs.pop(instance.instance_id, None)
        if proc is not None:
            await terminate([proc], STOP_GRACE_S)

    # -- supervision -------------------------------------------------------------
    def down(self, instance: Instance) -> bool:
        return self.supervisor.down(instance.instance_id)

    def restart_counts(self) -> dict[str, int]:
        return dict(self.supervisor.restarts)

    async def _respawn(self, instance_id: str) -> asyncio.subprocess.Process:
        """A new worker for a dead one: same id and port (the gateway's records stay valid),
        loading for `startup_s` like any engine that starts."""
        old = next((i for i in self._instances if i.instance_id == instance_id), None)
        if old is None:
            raise LookupError(f"{instance_id} is no longer part of the deployment")
        port = int(old.url.rsplit(":", 1)[1])
        try:
            await self._launch_one(instance_id, ["--startup-s", str(self.startup_s)], port=port)
        except Exception:
            proc = self._procs.get(instance_id)
            if proc is not None:  # e.g. started but never said it was ready: not left running
                await terminate([proc], STOP_GRACE_S)
            raise
        return self._procs[instance_id]

    async def _launch_one(self, instance_id: str, extra: list[str] | None = None, port: int = 0) -> Instance:
        role = self.role_of(instance_id)
        proc = await spawn([sys.executable, "-m", "engine_adapters.sim.worker", *self._args, *(extra or []),
                            "--pd-role", role,
                            "--host", self.host, "--port", str(port), "--instance-id", instance_id])
        self._procs[instance_id] = proc
        assert proc.stdout is not None
        try:
            line = await asyncio.wait_for(proc.stdout.readline(), READY_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise AdapterError(f"worker {instance_id} did not become ready in {READY_TIMEOUT_S:.0f} s") from None
        try:
            ready = json.loads(line)
            url = str(ready["url"])
        except (ValueError, KeyError, TypeError):
            code = await exit_code_soon(proc)
            raise AdapterError(f"worker {instance_id} failed to start (exit code {code})") from None
        # Keep reading stdout so a chatty worker can never block on a full pipe.
        asyncio.get_running_loop().create_task(drain(proc.stdout))
        return self._instance(instance_id, url)

    def role_of(self, instance_id: str) -> Role:
        """The fleet file's role of instance `prefix/i` (instances added later are mixed)."""
        i = int(instance_id.rsplit("/", 1)[1])
        return self.roles[i] if i < len(self.roles) else "mixed"

    def _instance(self, instance_id: str, url: str) -> Instance:
        role = self.role_of(instance_id)
        pd = role != "mixed" or any(r != "mixed" for r in self.roles)
        return Instance(instance_id=instance_id, site=self.site, model=self.model, version=self.version,
                        url=url, adapter=self.name, block_size=self.block_size,
                        max_model_len=self.max_model_len, engine_spec=self.spec, gpu=self.gpu,
                        tp=self.tp, max_batched_tokens=self.max_batched_tokens, role=role,
                        pd_protocol=self.pd_protocol if pd else None,
                        bootstrap_port=int(url.rsplit(":", 1)[1]) if role == "prefill" else None)

    async def stop(self) -> None:
        await self.supervisor.close()  # first: the stops below are not crashes
        await terminate(self._procs.values(), STOP_GRACE_S)
        self._procs.clear()
        await self.close_http()

    def kv_events(self, instance: Instance) -> AsyncIterator[KVEventBatch] | None:
        return ndjson_kv_events(self._http(), instance)

