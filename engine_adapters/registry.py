"""Build one adapter per deployment of a fleet file, and run them as a group."""

from __future__ import annotations

import asyncio
from collections import Counter

from engine_adapters.base import AdapterError, EngineAdapter, Instance
from engine_adapters.supervise import RestartPolicy
from fleetcore.fleet_config import DeploymentConfig, FleetConfig, FleetConfigError


def build_adapter(config: FleetConfig, d: DeploymentConfig, id_prefix: str) -> EngineAdapter:
    model = config.model(d.model)
    version = config.deployment_version(d)
    eng = model.engine
    if d.adapter == "static":
        from engine_adapters.static import StaticAdapter
        return StaticAdapter(id_prefix=id_prefix, site=d.site, model=d.model, version=version,
                             urls=d.urls, block_size=eng.block_size, max_model_len=eng.max_model_len,
                             engine_spec=eng.spec, gpu=d.gpu, tp=d.tp,
                             max_batched_tokens=eng.max_num_batched_tokens)
    if d.adapter == "sim":
        from engine_adapters.sim.launcher import SimAdapter
        _check_sim_hardware(eng.spec, d.gpu, d.tp, id_prefix)
        return SimAdapter(id_prefix=id_prefix, site=d.site, model=d.model, version=version,
                          instances=d.instance_count, spec=eng.spec, gpu=d.gpu, tp=d.tp,
                          block_size=eng.block_size, max_model_len=eng.max_model_len,
                          max_num_batched_tokens=eng.step_budget(d.instance_roles()),  # P/D: its budget
                          max_num_seqs=eng.max_num_seqs,
                          gpu_memory_utilization=eng.gpu_memory_utilization, options=d.options,
                          restart=restart_policy(config),
                          embedding_dim=model.embedding_dim if model.kind == "embedding" else None,
                          roles=d.instance_roles(), kv_link=_kv_link(config, d.site))
    if d.adapter in ("vllm", "sglang"):
        return _build_engine_adapter(config, d, id_prefix, version)
    raise FleetConfigError(f"deployment {id_prefix}: adapter {d.adapter!r} is not available yet")


def _build_engine_adapter(config: FleetConfig, d: DeploymentConfig, id_prefix: str,
                          version: str) -> EngineAdapter:
    """vLLM / SGLang: launch (options.model) or attach (options.urls); see engine_adapters.managed."""
    from fleetcore.model_tokenizer import load_tokenizer, tokenizer_source
    if d.adapter == "vllm":
        from engine_adapters.vllm import VLLMAdapter as cls
    else:
        from engine_adapters.sglang import SGLangAdapter as cls
    options = cls.options_class.parse(d.options, id_prefix)
    # Exact cache keys need the model's tokenizer in the gateway; without it the engines'
    # KV events are not subscribed to and the index stays approximate.
    src = tokenizer_source(config, d.model)
    exact = src is not None and load_tokenizer(src) is not None
    return cls(id_prefix=id_prefix, site=d.site, model=d.model, version=version,
               instances=d.instances, engine=config.model(d.model).engine, gpu=d.gpu, tp=d.tp,
               options=options, exact_kv=exact, restart=restart_policy(config), roles=d.instance_roles())


def _kv_link(config: FleetConfig, site: str) -> tuple[float, float]:
    """(GB/s, ms) of the site's interconnect, what a sim prefill worker sends KV by."""
    ic = config.site(site).interconnect
    return ic.bandwidth_gb_s, ic.latency_ms


def restart_policy(config: FleetConfig) -> RestartPolicy:
    """How launched engines are restarted when they die (the fleet file's `gateway:` block)."""
    g = config.gateway
    return RestartPolicy(g.engine_restart_backoff_s, max(g.engine_restart_backoff_max_s, g.engine_restart_backoff_s))


def _check_sim_hardware(spec: str, gpu: str, tp: int, where: str) -> None:
    """Fail at load time, not at launch, when the simulated model cannot exist."""
    from fleetcore import hardware
    from fleetcore.roofline import StepTimer
    try:
        StepTimer(hardware.model(spec), hardware.gpu(gpu), tp=tp).kv_capacity_tokens()
    except ValueError as e:
        raise FleetConfigError(f"deployment {where}: {e}") from None


def adapter_prefixes(config: FleetConfig) -> list[str]:
    """Each deployment's instance-id prefix: instance ids read `site/model/N` (`site/model#k/N`
    when a site runs several deployments of one model)."""
    seen: Counter[tuple[str, str]] = Counter()
    out = []
    for d in config.deployments:
        k = seen[(d.site, d.model)]
        seen[(d.site, d.model)] += 1
        out.append(f"{d.site}/{d.model}" + (f"#{k}" if k else ""))
    return out


def build_adapters(config: FleetConfig) -> list[EngineAdapter]:
    """One adapter per deployment (ids from `adapter_prefixes`)."""
    return [build_adapter(config, d, prefix) for d, prefix in zip(config.deployments, adapter_prefixes(config))]


async def launch_all(adapters: list[EngineAdapter]) -> list[Instance]:
    """Launch every adapter concurrently; if any fails, stop them all and raise."""
    results = await asyncio.gather(*(a.launch() for a in adapters), return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        await stop_all(adapters)
        raise errors[0] if isinstance(errors[0], AdapterError) else AdapterError(str(errors[0]))
    return [i for r in results if not isinstance(r, BaseException) for i in r]


async def stop_all(adapters: list[EngineAdapter]) -> None:
    await asyncio.gather(*(a.stop() for a in adapters), return_exceptions=True)
