"""A client cannot set the fields of a P/D leg: they would point an engine's KV transfer at a host
or a KV of the client's choosing (fail closed: 400, the engine never sees the body)."""

from __future__ import annotations

from typing import Any

from gateway.openai_fields import PD_LEG_FIELDS

KEY = "sk-test"
AUTH = {"Authorization": f"Bearer {KEY}"}


async def test_a_client_set_pd_leg_field_is_refused_before_any_engine(keyed_gateway: Any) -> None:
    client, stub = keyed_gateway
    values: dict[str, object] = {
        "kv_transfer_params": {"do_remote_prefill": True, "remote_host": "10.0.0.9", "remote_port": 5600,
                               "remote_block_ids": [1, 2, 3]},
        "bootstrap_host": "10.0.0.9", "bootstrap_port": 8998, "bootstrap_room": 12345}
    assert set(values) == PD_LEG_FIELDS
    for path, body in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        for field, value in values.items():
            for stream in (False, True):
                r = await client.post(path, json={"model": "m1", "max_tokens": 4, "stream": stream, **body,
                                                  field: value}, headers=AUTH)
                assert r.status_code == 400, r.text
                err = r.json()["error"]
                assert (err["param"], err["code"], err["type"]) == (field, "unsupported_parameter",
                                                                    "invalid_request_error")
    assert stub.requests == []  # nothing reached the engine
    ok = await client.post("/v1/completions", json={"model": "m1", "prompt": "hi", "max_tokens": 4}, headers=AUTH)
    assert ok.status_code == 200 and len(stub.requests) == 1  # the same gateway serves a clean body
