"""The vLLM adapter: `python -m vllm.entrypoints.openai.api_server` per instance, or attach.

Flags come from the fleet file's model engine config (max_model_len, block_size,
max_num_seqs, max_num_batched_tokens, or pd_max_num_batched_tokens where the
deployment has P/D roles (`ManagedEngineAdapter.step_budget`); gpu_memory_utilization
only when the file sets it, because on vLLM's CPU backend it also sizes host memory) plus what the
gateway needs from every engine: prefix caching, `prompt_tokens_details` in usage
(cached tokens), and KV events published to the gateway's subscriber. The module
is run with `-m` rather than the `vllm` console script because the CPU build's
script looks up a distribution named `vllm` and fails.

The block size passed to the engine is the model's `engine.block_size`, the same
size the gateway hashes request prefixes with, so that engine blocks and index
keys line up one to one (`engine_adapters.kv_translate`).
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import Field

from engine_adapters.base import Instance
from engine_adapters.managed import EngineOptions, ManagedEngineAdapter
from fleetcore.model_tokenizer import expand_path

# The environment the notes found necessary for offline engines; options.env overrides.
DEFAULT_ENV = {
    "HF_HUB_OFFLINE": "1",          # never reach for a model hub at start-up
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache on the CPU backend; GPUs ignore it
}


class VLLMOptions(EngineOptions):
    enforce_eager: bool = False  # skip graph capture: starts about twice as fast, runs slower
    num_gpu_blocks_override: int | None = Field(default=None, gt=0)  # shrink the KV cache (tests)
    # P/D (`roles`): NixlConnector's side channel of instance i is this port + i
    # (VLLM_NIXL_SIDE_CHANNEL_PORT; one per engine on a host).
    nixl_side_channel_port_base: int = Field(default=5600, gt=0, lt=65000)


# NixlConnector's KV roles per P/D role (vLLM's KVTransferConfig.kv_role).
KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}


class VLLMAdapter(ManagedEngineAdapter):
    name = "vllm"
    options_class = VLLMOptions
    options: VLLMOptions

    pd_protocol = "vllm"  # kv_transfer_params, prefill then decode (toy_proxy_server.py)

    def engine_argv(self, port: int, kv_events_config: dict[str, Any] | None, index: int = 0) -> list[str]:
        o, eng = self.options, self.engine
        assert o.model is not None
        model = expand_path(o.model)
        argv = [
            "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model) if model.exists() else o.model,  # a hub name stays a name
            "--served-model-name", self.model,
            "--host", o.host, "--port", str(port),
            "--enable-prefix-caching", "--enable-prompt-tokens-details",
            "--block-size", str(eng.block_size),
            "--max-model-len", str(eng.max_model_len),
            "--max-num-seqs", str(eng.max_num_seqs),
            "--max-num-batched-tokens", str(self.step_budget),
        ]
        if o.tokenizer:
            argv += ["--tokenizer", str(expand_path(o.tokenizer))]
        if "gpu_memory_utilization" in eng.model_fields_set:
            argv += ["--gpu-memory-utilization", str(eng.gpu_memory_utilization)]
        if self.tp > 1:
            argv += ["--tensor-parallel-size", str(self.tp)]
        if o.enforce_eager:
            argv.append("--enforce-eager")
        if o.num_gpu_blocks_override is not None:
            argv += ["--num-gpu-blocks-override", str(o.num_gpu_blocks_override)]
        if kv_events_config is not None:
            argv += ["--kv-events-config", json.dumps(kv_events_config, separators=(",", ":"))]
        kv_role = KV_ROLES.get(self.role_of(index))
        if kv_role is not None:  # disaggregated: NixlConnector moves the KV (needs GPUs and NIXL)
            argv += ["--kv-transfer-config", json.dumps({"kv_connector": "NixlConnector", "kv_role": kv_role},
                                                        separators=(",", ":"))]
        return argv + list(o.extra_args)

    def engine_env(self) -> dict[str, str]:
        return {**DEFAULT_ENV, **self.options.env}

    def instance_env(self, index: int) -> dict[str, str]:
        if self.role_of(index) == "mixed":
            return {}
        return {"VLLM_NIXL_SIDE_CHANNEL_HOST": self.options.host,
                "VLLM_NIXL_SIDE_CHANNEL_PORT": str(self.options.nixl_side_channel_port_base + index)}

    def kv_events_config(self, endpoint: str, topic: str) -> dict[str, Any]:
        # A host:port endpoint makes vLLM connect to us (it binds only on wildcards).
        return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint,
                "topic": topic}

    async def abort(self, instance: Instance, request_id: str) -> bool:
        # vLLM aborts a request when its HTTP connection closes, which the relay does;
        # it has no abort-by-id endpoint in the OpenAI server.
        return False
