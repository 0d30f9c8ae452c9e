"""The SGLang adapter: `python -m sglang.launch_server` per instance, or attach.

Same process handling, readiness, stop and KV events as vLLM (`managed`); SGLang's
publisher is a port of vLLM's and speaks the same wire format (array-encoded events).
Metrics come from `--enable-metrics` (`sglang:*`, mapped in `metrics_scrape`);
`--enable-cache-report` puts cached tokens into `usage.prompt_tokens_details`, which
the relay reads. The page size is the model's block size so that the KV events'
pages are the gateway's blocks. SGLang needs a GPU: on machines without one the
adapter is exercised with recorded metrics and a fake publisher only.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import Field

from engine_adapters.managed import EngineOptions, ManagedEngineAdapter
from fleetcore.model_tokenizer import expand_path

DEFAULT_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


class SGLangOptions(EngineOptions):
    mem_fraction_static: float | None = Field(default=None, gt=0, le=1)
    # P/D (`roles`): prefill instance i's bootstrap server listens on this port + i
    # (`--disaggregation-bootstrap-port`, SGLang's default 8998); the KV moves by this backend.
    bootstrap_port_base: int = Field(default=8998, gt=0, lt=65000)
    transfer_backend: str = "mooncake"


class SGLangAdapter(ManagedEngineAdapter):
    name = "sglang"
    options_class = SGLangOptions
    options: SGLangOptions

    pd_protocol = "sglang"  # bootstrap_host/port/room, both legs at once (sgl-router's PD mode)

    def bootstrap_port(self, index: int) -> int | None:
        return self.options.bootstrap_port_base + index if self.role_of(index) == "prefill" else None

    def engine_argv(self, port: int, kv_events_config: dict[str, Any] | None, index: int = 0) -> list[str]:
        o, eng = self.options, self.engine
        assert o.model is not None
        model = expand_path(o.model)
        argv = [
            "-m", "sglang.launch_server",
            "--model-path", str(model) if model.exists() else o.model,
            "--served-model-name", self.model,
            "--host", o.host, "--port", str(port),
            "--enable-metrics", "--enable-cache-report",
            "--page-size", str(eng.block_size),
            "--context-length", str(eng.max_model_len),
            "--max-running-requests", str(eng.max_num_seqs),
            "--chunked-prefill-size", str(self.step_budget),
            "--tp-size", str(self.tp),
        ]
        if o.tokenizer:
            argv += ["--tokenizer-path", str(expand_path(o.tokenizer))]
        if o.mem_fraction_static is not None:
            argv += ["--mem-fraction-static", str(o.mem_fraction_static)]
        if kv_events_config is not None:
            argv += ["--kv-events-config", json.dumps(kv_events_config, separators=(",", ":"))]
        role = self.role_of(index)
        if role != "mixed":
            argv += ["--disaggregation-mode", role, "--disaggregation-transfer-backend", o.transfer_backend]
            boot = self.bootstrap_port(index)
            if boot is not None:
                argv += ["--disaggregation-bootstrap-port", str(boot)]
        return argv + list(o.extra_args)

    def engine_env(self) -> dict[str, str]:
        return {**DEFAULT_ENV, **self.options.env}
