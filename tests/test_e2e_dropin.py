"""A real drop-in (issue 18): the `openai` SDK against a gateway on uvicorn over sim worker processes.

n choices and logprobs pass through and are accounted (usage, goodput ledger, budgets);
fields the gateway cannot honour are a 400 naming them."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import pytest_asyncio

from fleetcore.fleet_config import load_fleet_file
from gateway.embedded import serve_fleet

FLEET_FILE = Path(__file__).with_name("fleet_dropin.yaml")
KEY = "sk-dropin-acme"
ADMIN = "sk-dropin-admin"
MODEL = "llama-3.1-8b"
MSGS = [{"role": "user", "content": "Give me a few options."}]

pytestmark = pytest.mark.asyncio(loop_scope="module")


@dataclass
class Fleet:
    url: str
    app: Any

    def client(self, key: str = KEY) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=30)

    async def get(self, path: str, key: str = ADMIN) -> httpx.Response:
        async with httpx.AsyncClient(timeout=10) as c:
            return await c.get(f"{self.url}{path}", headers={"Authorization": f"Bearer {key}"})


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def fleet() -> AsyncIterator[Fleet]:
    async with serve_fleet(load_fleet_file(FLEET_FILE), poll_interval_s=0.2) as f:
        yield Fleet(f.url, f.app)


# --- 1. n, logprobs, unsupported fields ---

async def test_chat_n_choices_non_stream(fleet: Fleet) -> None:
    r = await fleet.client().chat.completions.create(model=MODEL, messages=MSGS, max_tokens=30, n=3, seed=7)
    assert [c.index for c in r.choices] == [0, 1, 2]
    texts = [c.message.content or "" for c in r.choices]
    assert len(set(texts)) == 3 and all(texts)
    assert r.usage is not None and r.usage.completion_tokens == sum(len(t.split()) for t in texts)
    again = await fleet.client().chat.completions.create(model=MODEL, messages=MSGS, max_tokens=30, n=3, seed=7)
    assert [c.message.content for c in again.choices] == texts  # deterministic


async def test_chat_n_choices_stream(fleet: Fleet) -> None:
    stream = await fleet.client().chat.completions.create(
        model=MODEL, messages=MSGS, max_tokens=15, n=2, stream=True, stream_options={"include_usage": True})
    parts: dict[int, list[str]] = {0: [], 1: []}
    finish: dict[int, str] = {}
    usage = None
    async for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            parts[c.index].append(c.delta.content or "")
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert set(finish) == {0, 1}
    assert usage is not None
    assert usage.completion_tokens == sum(1 for p in parts.values() for t in p if t)


async def test_n_choices_count_in_the_goodput_ledger(fleet: Fleet) -> None:
    key = "sk-dropin-counted"
    r = await fleet.client(key).completions.create(model=MODEL, prompt="List three colours", max_tokens=20, n=4)
    assert r.usage is not None and len(r.choices) == 4
    report = (await fleet.get("/v1/reports/goodput?tenant=counted")).json()
    assert report["totals"]["output_tokens"] == r.usage.completion_tokens  # sum over the choices


async def test_budget_charges_every_choice(fleet: Fleet) -> None:
    """tokens_per_minute 1000: 1 x 300 fits, 4 x 300 output budget does not (the prompt is shared)."""
    client = fleet.client("sk-dropin-tight")
    ok = await client.completions.create(model=MODEL, prompt="hello", max_tokens=300, n=1)
    assert ok.choices
    with pytest.raises(openai.RateLimitError) as e:
        await client.completions.create(model=MODEL, prompt="hello", max_tokens=300, n=4)
    assert e.value.response.headers.get("retry-after")


async def test_chat_logprobs_pass_through(fleet: Fleet) -> None:
    r = await fleet.client().chat.completions.create(model=MODEL, messages=MSGS, max_tokens=8,
                                                     logprobs=True, top_logprobs=2)
    lp = r.choices[0].logprobs
    assert lp is not None and lp.content
    assert "".join(t.token for t in lp.content) == r.choices[0].message.content
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in lp.content)
    stream = await fleet.client().chat.completions.create(model=MODEL, messages=MSGS, max_tokens=8,
                                                          logprobs=True, top_logprobs=2, stream=True)
    streamed = [t.token async for chunk in stream for c in chunk.choices if c.logprobs and c.logprobs.content
                for t in c.logprobs.content]
    assert streamed == [t.token for t in lp.content]


async def test_completion_logprobs_pass_through(fleet: Fleet) -> None:
    r = await fleet.client().completions.create(model=MODEL, prompt="Count", max_tokens=6, logprobs=3)
    lp = r.choices[0].logprobs
    assert lp is not None and lp.tokens and "".join(lp.tokens) == r.choices[0].text
    assert lp.top_logprobs is not None and all(len(d) == 3 for d in lp.top_logprobs)


@pytest.mark.parametrize("extra, param", [
    ({"store": True}, "store"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"n": 0}, "n"),
    ({"top_logprobs": 3}, "top_logprobs"),
])
async def test_unsupported_chat_fields_are_a_400_naming_them(fleet: Fleet, extra: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        await fleet.client().chat.completions.create(model=MODEL, messages=MSGS, max_tokens=4, extra_body=extra)
    assert e.value.body["param"] == param  # type: ignore[index]


async def test_field_the_engine_cannot_serve_is_its_400_not_ignored(fleet: Fleet) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        await fleet.client().completions.create(model=MODEL, prompt="x", max_tokens=4, echo=True)
    assert "echo" in str(e.value)


# --- 2. aliases and fallbacks ---

async def test_alias_keeps_the_requested_name(fleet: Fleet) -> None:
    raw = await fleet.client().chat.completions.with_raw_response.create(
        model="quick", messages=MSGS, max_tokens=5)  # quick -> fast -> llama-3.1-8b
    assert raw.parse().model == "quick"
    assert raw.headers["x-tokenfleet-served-model"] == MODEL
    assert "x-tokenfleet-fallback" not in raw.headers
    stream = await fleet.client().completions.create(model="fast", prompt="hi", max_tokens=4, stream=True)
    assert {c.model async for c in stream} == {"fast"}
    ids = {m.id: m for m in (await fleet.client().models.list()).data}
    assert {"fast", "quick", MODEL} <= set(ids) and "ghost" not in ids
    assert ids["quick"].model_extra["alias_of"] == MODEL  # type: ignore[index]
    # "retrieve model": the list's own entry, for a model and for an alias; 404 for what it lacks
    for name in ("quick", MODEL):
        got = await fleet.client().models.retrieve(name)
        assert got.model_dump() == ids[name].model_dump()
    for missing in ("ghost", "no-such-model", "meta-llama/no-such-model"):  # (ghost: nothing serves it)
        with pytest.raises(openai.NotFoundError) as e:
            await fleet.client().models.retrieve(missing)
        assert e.value.code == "model_not_found" and missing in str(e.value)
    with pytest.raises(openai.AuthenticationError):
        await fleet.client("sk-not-a-key").models.retrieve(MODEL)


async def test_unready_model_falls_back_visibly(fleet: Fleet) -> None:
    before = await _fallbacks(fleet)
    raw = await fleet.client().chat.completions.with_raw_response.create(model="ghost", messages=MSGS, max_tokens=5)
    r = raw.parse()
    assert r.model == "ghost" and r.choices[0].message.content
    assert raw.headers["x-tokenfleet-fallback"] == MODEL
    assert raw.headers["x-tokenfleet-served-model"] == MODEL
    stream = await fleet.client().chat.completions.create(model="ghost", messages=MSGS, max_tokens=5, stream=True)
    assert [c async for c in stream]
    assert await _fallbacks(fleet) == before + 2


async def test_fallback_is_not_for_budget_rejections(fleet: Fleet) -> None:
    before = await _fallbacks(fleet)
    with pytest.raises(openai.RateLimitError):
        await fleet.client("sk-dropin-tight").completions.create(model="ghost", prompt="x", max_tokens=300, n=8)
    assert await _fallbacks(fleet) == before


async def test_fallback_where_residency_forbids_is_refused(fleet: Fleet) -> None:
    """euonly may run llama-3.1-8b only in eu sites; it is deployed only in the us: ghost's
    fallback would break residency, so the request is refused, not served."""
    before = await _fallbacks(fleet)
    client = fleet.client("sk-dropin-euonly")
    with pytest.raises(openai.APIStatusError) as e:
        await client.chat.completions.create(model="ghost", messages=MSGS, max_tokens=5)
    assert e.value.status_code == 503
    assert "x-tokenfleet-fallback" not in e.value.response.headers
    assert await _fallbacks(fleet) == before
    with pytest.raises(openai.APIStatusError) as direct:  # the same policy on the model itself
        await client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=5)
    assert direct.value.status_code == 503
    ok = await fleet.client().chat.completions.create(model="ghost", messages=MSGS, max_tokens=5)
    assert ok.choices  # another tenant's ghost request does fall back


async def _fallbacks(fleet: Fleet) -> float:
    text = (await fleet.get("/metrics")).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("tokenfleet_fallbacks_total{") and 'model="ghost"' in line)


# --- 3. /v1/responses ---

async def test_responses_non_stream(fleet: Fleet) -> None:
    client = fleet.client()
    r = await client.responses.create(model=MODEL, input="Describe the fleet.", instructions="Be brief.",
                                      max_output_tokens=12)
    assert r.object == "response" and r.model == MODEL and r.status in ("completed", "incomplete")
    assert r.output_text
    assert r.usage is not None and 0 < r.usage.output_tokens <= 12 and r.usage.input_tokens > 0
    # The same conversation as chat gives the same words (deterministic engine, same prompt).
    chat = await client.chat.completions.create(
        model=MODEL, max_tokens=12, messages=[{"role": "system", "content": "Be brief."},
                                              {"role": "user", "content": "Describe the fleet."}])
    assert r.output_text == chat.choices[0].message.content


async def test_responses_messages_and_length_cut(fleet: Fleet) -> None:
    r = await fleet.client().responses.create(
        model="fast", max_output_tokens=3,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Tell a long story."}]}])
    assert r.model == "fast"  # the alias, as asked
    assert r.status == "incomplete" and r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage is not None and r.usage.output_tokens == 3


async def test_responses_stream_events(fleet: Fleet) -> None:
    client = fleet.client()
    stream = await client.responses.create(model=MODEL, input="Stream please.", max_output_tokens=16, stream=True)
    kinds, deltas, final = [], [], None
    async for ev in stream:
        kinds.append(ev.type)
        if ev.type == "response.output_text.delta":
            deltas.append(ev.delta)
        if ev.type in ("response.completed", "response.incomplete"):
            final = ev.response
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert final is not None and final.output_text == "".join(deltas)
    assert final.usage is not None and final.usage.output_tokens == len(deltas)
    whole = await client.responses.create(model=MODEL, input="Stream please.", max_output_tokens=16)
    assert whole.output_text == final.output_text


async def test_responses_go_through_admission_and_reports(fleet: Fleet) -> None:
    r = await fleet.client("sk-dropin-resp").responses.create(model=MODEL, input="Count me.", max_output_tokens=9)
    assert r.usage is not None
    totals = (await fleet.get("/v1/reports/goodput?tenant=resp")).json()["totals"]
    assert (totals["completed"], totals["output_tokens"]) == (1, r.usage.output_tokens)


@pytest.mark.parametrize("extra, param", [
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"store": True}, "store"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"stream_options": {"include_obfuscation": False}}, "stream_options"),
    ({"text": {"format": {"type": "json_object"}}}, "text"),
])
async def test_responses_stateful_or_unknown_fields_are_a_400(fleet: Fleet, extra: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        await fleet.client().responses.create(model=MODEL, input="x", extra_body=extra)
    assert e.value.body["param"] == param  # type: ignore[index]


async def test_responses_bad_input_names_input(fleet: Fleet) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        await fleet.client().responses.create(model=MODEL, input=[{"role": "wizard", "content": "x"}])
    assert e.value.body["param"] == "input[0].role"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as e:
        await fleet.client().responses.create(model=MODEL, input=[{"type": "function_call_output",
                                                                   "call_id": "c", "output": "x"}])
    assert e.value.body["param"] == "input[0].type"  # type: ignore[index]


# --- 4. /v1/embeddings ---

EMBED = "embed-small"


async def test_embeddings_deterministic_unit_vectors(fleet: Fleet) -> None:
    client = fleet.client()
    r = await client.embeddings.create(model=EMBED, input=["alpha beta", "gamma", "alpha beta"])  # SDK: base64
    assert [d.index for d in r.data] == [0, 1, 2] and r.model == EMBED
    vecs = [d.embedding for d in r.data]
    assert all(len(v) == 256 for v in vecs)
    assert all(abs(sum(x * x for x in v) - 1.0) < 1e-4 for v in vecs)
    assert vecs[0] == vecs[2] and vecs[0] != vecs[1]
    assert r.usage.prompt_tokens == r.usage.total_tokens > 0
    floats = await client.embeddings.create(model=EMBED, input="gamma", encoding_format="float")
    assert max(abs(a - b) for a, b in zip(floats.data[0].embedding, vecs[1])) < 1e-6  # float32 vs float
    short = await client.embeddings.create(model=EMBED, input="gamma", dimensions=64, encoding_format="float")
    v = short.data[0].embedding
    assert len(v) == 64 and abs(sum(x * x for x in v) - 1.0) < 1e-6


async def test_embeddings_are_routed_and_reported(fleet: Fleet) -> None:
    raw = await fleet.client().embeddings.with_raw_response.create(model=EMBED, input="where did I go")
    assert raw.headers["x-tokenfleet-served-model"] == EMBED
    assert raw.headers["x-tokenfleet-instance"].startswith("east/embed-small/")


async def test_embedding_and_chat_models_do_not_mix(fleet: Fleet) -> None:
    client = fleet.client()
    with pytest.raises(openai.BadRequestError) as e:
        await client.chat.completions.create(model=EMBED, messages=MSGS, max_tokens=4)
    assert e.value.body["param"] == "model" and "embedding model" in e.value.message  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as e:
        await client.embeddings.create(model=MODEL, input="x")
    assert e.value.body["param"] == "model"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as e:
        await client.responses.create(model=EMBED, input="x")
    assert e.value.body["param"] == "model"  # type: ignore[index]


@pytest.mark.parametrize("body, param", [
    ({"input": []}, "input"),
    ({"input": ["ok", 5]}, "input[1]"),
    ({"input": "x", "dimensions": 999}, "dimensions"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "word " * 2000}, "input[0]"),
])
async def test_bad_embedding_bodies(fleet: Fleet, body: dict[str, Any], param: str) -> None:
    async with httpx.AsyncClient(timeout=10) as c:
        r = await c.post(f"{fleet.url}/v1/embeddings", json={"model": EMBED, **body},
                         headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == param


# --- 5. keys by API ---

async def _admin(fleet: Fleet, method: str, path: str, body: Any = None, key: str = ADMIN) -> httpx.Response:
    async with httpx.AsyncClient(timeout=10) as c:
        return await c.request(method, f"{fleet.url}{path}", json=body,
                               headers={"Authorization": f"Bearer {key}"} if key else {})


async def test_keys_create_use_list_rotate_revoke(fleet: Fleet, caplog: pytest.LogCaptureFixture) -> None:
    from fleetcore.fleet_config import hash_api_key
    from gateway.keys import KVKeyStore

    caplog.set_level("INFO", logger="tokenfleet.audit")
    r = await _admin(fleet, "POST", "/admin/v1/keys", {"tenant": "acme", "name": "ci",
                                                        "expires_at": "2099-01-01T00:00:00Z"})
    assert r.status_code == 201
    created = r.json()
    key, key_id = created["key"], created["id"]
    assert key.startswith("sk-tf-") and created["tenant"] == "acme" and created["expires_at"].startswith("2099")
    chat = await fleet.client(key).chat.completions.create(model=MODEL, messages=MSGS, max_tokens=3)
    assert chat.choices
    listing = await _admin(fleet, "GET", "/admin/v1/keys")
    assert key not in listing.text and hash_api_key(key) not in listing.text  # never the key or its hash
    row = next(k for k in listing.json()["data"] if k["id"] == key_id)
    assert (row["name"], row["tenant"], row["revoked"]) == ("ci", "acme", False)
    assert row["created_at"] and row["last_used_at"]
    store = fleet.app.state.tokenfleet.auth.keys
    assert isinstance(store, KVKeyStore)
    stored = await store.kv.get(f"keys:rec:{key_id}")
    assert key not in stored and hash_api_key(key) in stored  # stored hashed
    assert await KVKeyStore(store.kv).get(key_id) is not None  # another store over the same admin store sees it

    rotated = await _admin(fleet, "POST", f"/admin/v1/keys/{key_id}/rotate")
    assert rotated.status_code == 200 and rotated.json()["id"] == key_id
    new_key = rotated.json()["key"]
    with pytest.raises(openai.AuthenticationError):
        await fleet.client(key).models.list()
    assert (await fleet.client(new_key).models.list()).data

    assert (await _admin(fleet, "DELETE", f"/admin/v1/keys/{key_id}")).json()["revoked"] is True
    with pytest.raises(openai.AuthenticationError) as e:
        await fleet.client(new_key).models.list()
    assert "revoked" in e.value.message
    assert (await _admin(fleet, "POST", f"/admin/v1/keys/{key_id}/rotate")).status_code == 409
    audit = (await _admin(fleet, "GET", "/admin/v1/keys/audit")).json()["data"]
    mine = [a["action"] for a in audit if a["key_id"] == key_id]
    assert mine == ["revoke", "rotate", "create"]
    assert all(a["actor"].startswith("admin:") for a in audit)
    logged = [r.fields for r in caplog.records if r.name == "tokenfleet.audit"  # type: ignore[attr-defined]
              and r.fields.get("key_id") == key_id]  # type: ignore[attr-defined]
    assert [f["action"] for f in logged] == ["create", "rotate", "revoke"]
    assert not any(key in r.getMessage() or new_key in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("method, path, body, key, status, param", [
    ("POST", "/admin/v1/keys", {"tenant": "nobody"}, ADMIN, 400, "tenant"),
    ("POST", "/admin/v1/keys", {"tenant": "acme", "expires_at": "2001-01-01T00:00:00Z"}, ADMIN, 400, "expires_at"),
    ("POST", "/admin/v1/keys", {"tenant": "acme", "expires_at": "soon"}, ADMIN, 400, "expires_at"),
    ("POST", "/admin/v1/keys", {"tenant": "acme", "expires_at": 1e300}, ADMIN, 400, "expires_at"),
    ("POST", "/admin/v1/keys", [1, 2], ADMIN, 400, None),
    ("POST", "/admin/v1/keys", {"tenant": "acme", "colour": "red"}, ADMIN, 400, "colour"),
    ("POST", "/admin/v1/keys", {"tenant": "acme"}, KEY, 403, None),
    ("POST", "/admin/v1/keys", {"tenant": "acme", "budgets": {"requests_per_minute": 0}}, ADMIN, 400,
     "budgets.requests_per_minute"),
    ("POST", "/admin/v1/keys", {"tenant": "acme", "budgets": {"rpm": 5}}, ADMIN, 400, "budgets.rpm"),
    ("GET", "/admin/v1/keys", None, "", 401, None),
    ("DELETE", "/admin/v1/keys/key_nope", None, ADMIN, 404, None),
    ("POST", "/admin/v1/keys/key_nope/rotate", None, ADMIN, 404, None),
])
async def test_keys_api_errors(fleet: Fleet, method: str, path: str, body: Any, key: str, status: int,
                               param: str | None) -> None:
    r = await _admin(fleet, method, path, body, key)
    assert r.status_code == status
    assert r.json()["error"]["param"] == param


async def test_expired_key_is_refused(fleet: Fleet) -> None:
    import time as _time

    r = await _admin(fleet, "POST", "/admin/v1/keys", {"tenant": "acme", "expires_at": _time.time() + 1.0})
    key = r.json()["key"]
    assert (await fleet.client(key).models.list()).data
    await asyncio.sleep(1.2)
    with pytest.raises(openai.AuthenticationError):
        await fleet.client(key).models.list()


async def test_api_key_reads_its_tenants_report(fleet: Fleet) -> None:
    created = (await _admin(fleet, "POST", "/admin/v1/keys", {"tenant": "acme"})).json()
    report = await fleet.get("/v1/reports/goodput", key=created["key"])
    assert report.status_code == 200 and report.json()["tenant"] == "acme"
    assert (await fleet.get("/v1/reports/goodput?tenant=counted", key=created["key"])).status_code == 403
    await _admin(fleet, "DELETE", f"/admin/v1/keys/{created['id']}")
    assert (await fleet.get("/v1/reports/goodput", key=created["key"])).status_code == 401


async def test_responses_and_embeddings_get_their_access_log_line(fleet: Fleet,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="tokenfleet.access")
    client = fleet.client()
    stream = await client.responses.create(model=MODEL, input="log me", max_output_tokens=4, stream=True,
                                           extra_headers={"x-request-id": "req-resp-log"})
    assert [e async for e in stream]
    await client.embeddings.create(model=EMBED, input="log me too", extra_headers={"x-request-id": "req-emb-log"})
    with pytest.raises(openai.BadRequestError):
        await client.responses.create(model=MODEL, input="x", extra_headers={"x-request-id": "req-resp-bad"},
                                      extra_body={"store": True})
    by_id = {r.fields["request_id"]: r.fields for r in caplog.records  # type: ignore[attr-defined]
             if r.name == "tokenfleet.access"}
    assert (by_id["req-resp-log"]["op"], by_id["req-resp-log"]["status"]) == ("responses", "200")
    assert by_id["req-resp-log"]["tokens_out"] > 0
    assert (by_id["req-emb-log"]["op"], by_id["req-emb-log"]["model"]) == ("embeddings", EMBED)
    assert by_id["req-resp-bad"]["status"] == "400"


ODD_BODIES: list[Any] = [None, [], "x", 5, {}, {"model": None}, {"model": MODEL, "input": {"a": 1}},
                         {"model": MODEL, "input": [None]}, {"model": MODEL, "input": [[1, -2]]},
                         {"model": MODEL, "input": [{"role": "user", "content": [{"type": "input_text"}]}]},
                         {"model": MODEL, "input": "x", "instructions": ["a"]},
                         {"model": MODEL, "input": "x", "text": "plain"},
                         {"model": MODEL, "input": "x", "metadata": [1]},
                         {"model": MODEL, "input": "x", "temperature": "hot"},
                         {"model": EMBED, "input": [True, False]}, {"model": EMBED, "input": "x", "dimensions": True},
                         {"tenant": ["acme"]}, {"tenant": "acme", "name": 7}, {"tenant": "acme", "expires_at": True}]


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/embeddings", "/admin/v1/keys"])
async def test_odd_bodies_are_4xx_never_5xx(fleet: Fleet, path: str) -> None:
    key = ADMIN if path.startswith("/admin") else KEY
    async with httpx.AsyncClient(timeout=10) as c:
        for body in ODD_BODIES:
            r = await c.post(f"{fleet.url}{path}", content=json.dumps(body),
                             headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
            assert 400 <= r.status_code < 500, (body, r.status_code, r.text)
            assert r.json()["error"]["message"]
