"""The static adapter: engines at given URLs; launch only attaches, stop leaves them running."""

from __future__ import annotations

from engine_adapters.base import Instance
from engine_adapters.http_engine import HttpEngineAdapter


class StaticAdapter(HttpEngineAdapter):
    name = "static"

    def __init__(self, *, id_prefix: str, site: str, model: str, version: str, urls: list[str],
                 block_size: int = 16, max_model_len: int = 8192, engine_spec: str | None = None,
                 gpu: str | None = None, tp: int = 1, max_batched_tokens: int = 8192) -> None:
        super().__init__()
        self._instances = [
            Instance(instance_id=f"{id_prefix}/{i}", site=site, model=model, version=version,
                     url=url.rstrip("/"), adapter=self.name, block_size=block_size,
                     max_model_len=max_model_len, engine_spec=engine_spec, gpu=gpu, tp=tp,
                     max_batched_tokens=max_batched_tokens)
            for i, url in enumerate(urls)
        ]

    @property
    def instances(self) -> list[Instance]:
        return list(self._instances)

    async def launch(self) -> list[Instance]:
        # Attaching never fails the fleet: an engine that is down now is marked
        # unready by the health poller and joins when it answers.
        return self.instances

    async def stop(self) -> None:
        await self.close_http()
