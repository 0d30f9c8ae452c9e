"""Aliases and fallbacks without engines: fleet-file checks and the fallback rules."""

from __future__ import annotations

from typing import Any

import pytest
from starlette.responses import Response

from fleetcore.fleet_config import FleetConfigError, parse_fleet
from gateway.aliases import renamed_body, renamed_event, serve_with_fallbacks
from gateway.errors import GatewayError, no_ready_instance, overloaded, rate_limited
from gateway.metrics import GatewayMetrics

SITES = [{"name": "a", "region": "r", "jurisdiction": "j"}]
ENGINE = {"spec": "llama-3.1-8b"}


def fleet(aliases: dict[str, str], fallbacks: list[str] | None = None) -> Any:
    models = [{"name": "m1", "engine": ENGINE, "versions": ["v1", "v2"], "fallbacks": fallbacks or []},
              {"name": "m2", "engine": ENGINE}]
    return parse_fleet({"sites": SITES, "models": models, "aliases": aliases})


@pytest.mark.parametrize("aliases, fallbacks, error", [
    ({"x": "nope"}, None, "unknown model 'nope'"),
    ({"m2": "m1"}, None, "shadows the model"),
    ({"x": "y", "y": "z", "z": "x"}, None, "cycle x -> y -> z -> x"),
    ({"x": "m1@v9"}, None, "has no version 'v9'"),
    ({"bad@name": "m1"}, None, "not a valid model name"),
    ({}, ["m1"], "falls back to itself"),
    ({}, ["nope"], "fallback 'nope' is not a model or alias"),
])
def test_bad_aliases_and_fallbacks_are_fleet_file_errors(aliases: dict[str, str], fallbacks: list[str] | None,
                                                         error: str) -> None:
    with pytest.raises(FleetConfigError, match=error):
        fleet(aliases, fallbacks)


def test_alias_chains_and_versions_resolve() -> None:
    c = fleet({"a": "b", "b": "m1@v2", "c": "m2"}, ["c"])
    assert c.resolve_alias("a") == "m1@v2" and c.resolve_alias("m2") == "m2"


def test_cycle_reported_once() -> None:
    with pytest.raises(FleetConfigError) as e:
        fleet({"x": "y", "y": "x"})
    assert str(e.value).count("cycle") == 1


def test_renaming_keeps_everything_else() -> None:
    raw = b'data: {"id":"c1","model":"served","choices":[]}\n\n'
    assert renamed_event(raw, {"id": "c1", "model": "served", "choices": []}, "alias") == \
        b'data: {"id":"c1","model":"alias","choices":[]}\n\n'
    assert renamed_event(b"data: [DONE]\n\n", None, "alias") == b"data: [DONE]\n\n"
    assert renamed_body(b'{"model":"served","x":1}', "alias") == b'{"model":"alias","x":1}'
    assert renamed_body(b"not json", "alias") == b"not json"


class FakeRelay:
    """Answers per model: an exception to raise or a Response."""

    def __init__(self, answers: dict[str, Any]) -> None:
        self.answers = answers
        self.asked: list[str] = []

    async def handle(self, request: Any, parsed: Any, path: str) -> Response:
        self.asked.append(parsed.profile.model)
        a = self.answers[parsed.profile.model]
        if isinstance(a, Exception):
            raise a
        return a


class P:
    def __init__(self, model: str, fallbacks: list[str]) -> None:
        self.profile = type("Prof", (), {"model": model, "request_id": "r1"})()
        self.model = type("M", (), {"fallbacks": fallbacks})()


async def _serve(answers: dict[str, Any], fallbacks: list[str]) -> tuple[Any, FakeRelay, GatewayMetrics]:
    relay, metrics = FakeRelay(answers), GatewayMetrics()

    async def reparse(name: str) -> Any:
        if name == "too-small":
            raise GatewayError(400, "does not fit", code="context_length_exceeded")
        return P(name, [])

    try:
        out: Any = await serve_with_fallbacks(relay, metrics, None, P("main", fallbacks), "/v1/x",  # type: ignore[arg-type]
                                              reparse)
    except GatewayError as e:
        out = e
    return out, relay, metrics


async def test_slo_unattainable_falls_back_in_order_skipping_what_cannot_serve() -> None:
    answers = {"main": overloaded("slow", "slo_unattainable", 1), "b": no_ready_instance("b"),
               "c": Response(b"ok")}
    resp, relay, metrics = await _serve(answers, ["too-small", "b", "c"])
    assert isinstance(resp, Response) and resp.headers["x-tokenfleet-fallback"] == "c"
    assert relay.asked == ["main", "b", "c"]
    assert metrics.fallbacks.labels("main", "c", "slo_unattainable")._value.get() == 1


@pytest.mark.parametrize("error", [rate_limited("over budget", 3), overloaded("full", "queue_full", 1),
                                   GatewayError(400, "bad")])
async def test_no_fallback_for_budget_queue_or_bad_input(error: GatewayError) -> None:
    out, relay, _ = await _serve({"main": error, "b": Response(b"ok")}, ["b"])
    assert out is error and relay.asked == ["main"]


async def test_when_no_fallback_serves_the_client_gets_the_first_error() -> None:
    first = no_ready_instance("main")
    out, relay, _ = await _serve({"main": first, "b": overloaded("slow", "slo_unattainable", 1)}, ["b"])
    assert out is first and relay.asked == ["main", "b"]
