"""Prefill/decode disaggregation through the gateway: TokenPilot's P/D decision, and the P -> D flow
each engine protocol expects (issue 17).

Where a request's pool has prefill instances (a deployment's `roles`), the instance is chosen
by `tokenpilot.disagg.TokenPilotDisagg` (its public `decide`, through the same `fleetmind.place`
as every other choice: exclusions, the avoid hint, the site chooser) instead of the plain
router. A local decision is an ordinary dispatch to that instance. A split one runs the flow
the prefill instance's adapter declares (`Instance.pd_protocol`):

* `sglang` (SGLang's PD router): the request goes to the prefill and the decode instance at
  once, both bodies carrying `bootstrap_host`, `bootstrap_port` (the prefill's) and a random
  63-bit `bootstrap_room`; the client reads the decode instance's answer.
* `vllm` (vLLM's NixlConnector proxy): the prefill instance first, with `kv_transfer_params:
  {"do_remote_decode": true, ...}`, `max_tokens: 1`, `stream: false`; then the original request
  to the decode instance with the `kv_transfer_params` the prefill answered.

Both legs run under the hardening deadlines: the prefill leg must answer within the first-byte
deadline (`gateway.deadlines`, `fleetcore.first_byte`), the decode leg is an ordinary relay
dispatch (first byte, idle, continuation after the first token). A failed or stalled prefill
leg never leaves a decode waiting: the decode leg is cancelled (its connection closed, which
makes the engine free the room's reservation), and the request is retried once locally (a
decode or mixed instance prefilling itself) before the client's first byte, by the relay's own
attempt loop (`SplitFailed` names what to leave out); if that fails too, the client gets the
OpenAI-style 502/504. `tokenfleet_pd_legs_total` counts both legs'
outcomes and the decision log names both instances.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import aiohttp
from prometheus_client import Counter
from starlette.responses import Response

from fleetcore import hardware
from fleetcore.fleet_config import FleetConfig
from fleetcore.interconnect import kv_bytes, link_between
from fleetcore.sse import MAX_EVENT_BYTES
from fleetcore.types import Candidate, InstanceSnapshot, RequestProfile, RouteDecision
from fleetmind.place import Choice, place
from gateway.background import cancel_and_wait
from gateway.relay import CLIENT_CLOSED, ClientGone, DisconnectWatch, Relay, Target, upstream_fields
from gateway.requests import ParsedRequest
from gateway.upstream_failure import RetryableFailure, SplitFailed, describe
from gateway.upstream_http import BodyTooLarge
from tokenpilot.disagg import DisaggPolicy, PDDecision, TokenPilotDisagg
from tokenpilot.router import TokenPilot

if TYPE_CHECKING:
    from gateway.fleet_state import FleetState

log = logging.getLogger("tokenfleet.gateway")

# What vLLM's proxy sends the prefill instance (toy_proxy_server.py).
_VLLM_PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                        "remote_block_ids": None, "remote_host": None, "remote_port": None}


class PrefillFailed(Exception):
    """The prefill leg failed or stalled; `public` is what a client may read."""

    def __init__(self, kind: str, public: str, timed_out: bool = False) -> None:
        super().__init__(f"{kind}: {public}")
        self.kind = kind
        self.public = public
        self.timed_out = timed_out


class LiveLinks:
    """`tokenpilot.disagg.Transfers` for the gateway: the fleet file's links
    (`fleetcore.interconnect`), the model's KV bytes per token. The gateway does not see the
    engines' link queues, so a prediction is an idle link's time."""

    def __init__(self, config: FleetConfig, state: FleetState) -> None:
        self.config = config
        self.state = state

    def predict_s(self, src: str, dst: str, tokens: int, now: float) -> float:
        a, b = self.state.get(src), self.state.get(dst)
        if a is None or b is None or b.instance.engine_spec is None:
            return 0.0
        try:
            model = hardware.model(b.instance.engine_spec)
            link = link_between(self.config, a.instance.site, b.instance.site)
        except (KeyError, ValueError):
            return 0.0
        return link.transfer_s(kv_bytes(model, tokens))


class _DecideAsRoute:
    """The P/D decision in a router's shape, for `fleetmind.place`: the decode (or local) instance
    is the route; the whole decision is kept for the caller."""

    def __init__(self, policy: DisaggPolicy, links: LiveLinks, local_only: bool) -> None:
        self.policy = policy
        self.links = links
        self.local_only = local_only
        self.last: PDDecision | None = None

    def route(self, profile: RequestProfile, pool: Sequence[InstanceSnapshot], now: float) -> RouteDecision:
        if self.local_only:  # a retry prefills where it decodes
            pool = [i for i in pool if i.role != "prefill"]
        d = self.last = self.policy.decide(profile, pool, self.links, now)
        cands: tuple[Candidate, ...] = ()
        reason = d.reason
        if d.split:
            reason = f"{d.reason}; prefill {d.prefill} -> decode {d.decode}"
            cands = (Candidate(str(d.prefill), 0.0, {"leg_prefill": 1.0, "transfer_s": d.transfer_s}),
                     Candidate(str(d.decode), 0.0, {"leg_decode": 1.0}))
        return RouteDecision(d.decode, reason, cands, d.predicted_ttft_s, d.cached_tokens)


@dataclass(slots=True)
class PDMetrics:
    legs: Counter

    @classmethod
    def create(cls, registry: Any) -> PDMetrics:
        return cls(Counter("tokenfleet_pd_legs", "Disaggregated requests' legs by protocol and outcome "
                           "(ok, failed, stalled, aborted, retried_local)", ["model", "protocol", "leg", "outcome"],
                           registry=registry))


class PDFlow:
    """The relay's P/D half (`Relay.pd`): choice for P/D pools, and the split flow."""

    def __init__(self, relay: Relay, policy: DisaggPolicy) -> None:
        self.relay = relay
        self.policy = policy
        self.links = LiveLinks(relay.config, relay.state)
        self.metrics = PDMetrics.create(relay.metrics.registry)
        self._background: set[asyncio.Task[Any]] = set()  # prefill legs outliving their decode's start

    @classmethod
    def for_relay(cls, relay: Relay) -> PDFlow | None:
        """A flow when the fleet has prefill instances and the router is TokenPilot (whose cost
        model prices the split); None otherwise: nothing changes."""
        has_prefill = any((d.roles or {}).get("prefill", 0) for d in relay.config.deployments)
        if not has_prefill or not isinstance(relay.router, TokenPilot):
            return None
        return cls(relay, TokenPilotDisagg(relay.router))

    def _pd_pool(self, profile: RequestProfile) -> bool:
        return any(st.instance.role == "prefill" and st.instance.model == profile.model
                   for st in self.relay.state.states())

    # -- choice --------------------------------------------------------------------------
    def choose(self, profile: RequestProfile, excluded: Collection[str], attempt: int,
               avoid: Collection[str] = ()) -> Target | None:
        """`Relay.choose` for a P/D pool: TokenPilot's P/D decision. A split target carries the
        prefill instance in `prefill`; retries (attempt > 0) stay local."""
        relay = self.relay
        if not self._pd_pool(profile):
            return relay.choose(profile, excluded, attempt, avoid)
        router = _DecideAsRoute(self.policy, self.links, local_only=attempt > 0)
        choice: Choice = place(profile, relay.state.view(), relay.clock(), relay.site_chooser, router,  # type: ignore[arg-type]
                               exclude=excluded, avoid=avoid)
        for t in choice.tries():
            relay.decisions.add(profile, attempt, t.excluded, t.site, t.route)
        st = relay.state.get(choice.instance.instance_id) if choice.instance is not None else None
        if st is None or choice.site.site is None:
            return None
        target = Target(choice.site.site, st.instance, choice.route, choice.site.reason)
        d = router.last
        if d is not None and d.split and d.prefill is not None:
            pre = relay.state.get(d.prefill)
            if pre is not None:
                # The prefill leg's own TTFT (the split's less the transfer; the round trip to the site,
                # which `place` added to the split's, its too): its first-byte deadline ends before the
                # decode leg's, so a stalled prefill is seen first and blamed.
                split = choice.route.predicted_ttft_s if choice.route is not None else None
                own = split - d.transfer_s if split is not None else None
                target.prefill = Target(choice.site.site, pre.instance,
                                        RouteDecision(d.prefill, d.reason, (), own, d.cached_tokens),
                                        choice.site.reason)
        return target

    # -- the split flow ------------------------------------------------------------------
    async def run(self, watch: DisconnectWatch, parsed: ParsedRequest, path: str, target: Target) -> Response:
        """A split request: both legs, the protocol's way. A failure before the first byte raises
        SplitFailed: the relay's attempt loop retries it once, locally (`choose`, attempt > 0)."""
        pre = target.prefill
        assert pre is not None
        dec = replace(target, prefill=None)
        protocol = pre.instance.pd_protocol or "sglang"
        model = parsed.profile.model
        try:
            if protocol == "vllm":
                return await self._vllm(watch, parsed, path, pre, dec)
            return await self._sglang(watch, parsed, path, pre, dec)
        except PrefillFailed as f:
            self.metrics.legs.labels(model, protocol, "prefill", "stalled" if f.timed_out else "failed").inc()
            log.warning("request %s: prefill leg on %s failed (%s); retrying locally", parsed.profile.request_id,
                        pre.instance.instance_id, f)
            self.relay.state.mark_failed(pre.instance.instance_id, f"prefill leg: {f}")
            self.metrics.legs.labels(model, protocol, "decode", "retried_local").inc()
            raise SplitFailed([pre.instance.instance_id]) from None

    async def _sglang(self, watch: DisconnectWatch, parsed: ParsedRequest, path: str, pre: Target,
                      dec: Target) -> Response:
        relay = self.relay
        fields = {"bootstrap_host": urlsplit(pre.instance.url).hostname,
                  "bootstrap_port": pre.instance.bootstrap_port or urlsplit(pre.instance.url).port,
                  "bootstrap_room": secrets.randbits(63)}
        body = upstream_fields(parsed, pre.instance.model)
        body.update(fields, stream=False)
        body.pop("stream_options", None)
        prefill = asyncio.create_task(self._prefill(parsed, path, pre, body))
        decode = asyncio.create_task(relay._dispatch(watch, replace(parsed, body={**parsed.body, **fields}), path, dec))
        try:
            await asyncio.wait({prefill, decode}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            for t in (prefill, decode):
                t.cancel()
            raise
        if prefill.done() and prefill.exception() is not None and not decode.done():
            # The prefill leg is gone: the decode must not wait for its room.
            await cancel_and_wait([decode])
            self.metrics.legs.labels(parsed.profile.model, "sglang", "decode", "aborted").inc()
            raise prefill.exception()  # type: ignore[misc]
        try:
            resp = await decode
        except RetryableFailure as f:
            await self._decode_failed(parsed, prefill, pre, dec, f, "sglang")
            raise AssertionError("unreachable")  # _decode_failed raises
        except BaseException:
            await cancel_and_wait([prefill])
            raise
        self._after_decode(parsed, prefill, resp, "sglang")
        return resp

    async def _vllm(self, watch: DisconnectWatch, parsed: ParsedRequest, path: str, pre: Target,
                    dec: Target) -> Response:
        body = upstream_fields(parsed, pre.instance.model)
        body.update(kv_transfer_params=dict(_VLLM_PREFILL_PARAMS), max_tokens=1, stream=False)
        if "max_completion_tokens" in body:
            body["max_completion_tokens"] = 1
        body.pop("stream_options", None)
        try:
            answer = await watch.race(self._prefill(parsed, path, pre, body))
        except ClientGone:
            if watch.take_gone():
                self.relay.metrics.answered(parsed.profile.model, "", "", str(CLIENT_CLOSED))
            return Response(status_code=CLIENT_CLOSED)
        params = answer.get("kv_transfer_params")
        if not isinstance(params, dict):
            raise PrefillFailed("prefill_answer", f"engine instance {pre.instance.instance_id} answered "
                                "without kv_transfer_params")
        self.metrics.legs.labels(parsed.profile.model, "vllm", "prefill", "ok").inc()
        try:
            resp = await self.relay._dispatch(watch, replace(parsed, body={**parsed.body, "kv_transfer_params": params}),
                                              path, dec)
        except RetryableFailure as f:
            done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            done.set_result(None)
            await self._decode_failed(parsed, done, pre, dec, f, "vllm")
            raise AssertionError("unreachable")
        self.metrics.legs.labels(parsed.profile.model, "vllm", "decode", _outcome(resp.status_code)).inc()
        return resp


    async def _prefill(self, parsed: ParsedRequest, path: str, pre: Target, body: dict[str, Any]) -> dict[str, Any]:
        """The prefill leg: a whole answer within the first-byte deadline, counted in flight."""
        relay = self.relay
        iid = pre.instance.instance_id
        assert relay.session is not None
        predicted = pre.route.predicted_ttft_s if pre.route is not None else None
        deadline = relay.deadlines.first_byte_s(predicted)
        relay.metrics.set_inflight(iid, relay.state.begin(iid))
        try:
            async with asyncio.timeout(deadline):
                r = await relay.session.post(pre.instance.url + path, data=json.dumps(body).encode(),
                                             headers={"Content-Type": "application/json",
                                                      "X-Request-Id": f"{parsed.profile.request_id}-prefill"})
                async with r:  # released when read, closed on any failure (the engine drops the room)
                    raw = await r.read(MAX_EVENT_BYTES)
                    if r.status != 200:
                        raise PrefillFailed(f"prefill_http_{r.status}",
                                            f"engine instance {iid} answered the prefill leg with HTTP {r.status}")
            try:
                out = json.loads(raw)
            except ValueError:
                raise PrefillFailed("prefill_answer", f"engine instance {iid} sent an unreadable prefill answer") from None
            return out if isinstance(out, dict) else {}
        except BodyTooLarge:
            raise PrefillFailed("prefill_answer", f"engine instance {iid} sent a prefill answer larger than "
                                f"{MAX_EVENT_BYTES} bytes") from None
        except TimeoutError:
            raise PrefillFailed("prefill_timeout", f"engine instance {iid} did not prefill within {deadline:.1f} s",
                                timed_out=True) from None
        except (aiohttp.ClientError, OSError) as e:
            log.info("prefill leg on %s: %s", iid, describe(e))
            raise PrefillFailed("prefill_connect", f"engine instance {iid} prefill leg connection failed") from None
        finally:
            relay.metrics.set_inflight(iid, relay.state.end(iid))

    def _after_decode(self, parsed: ParsedRequest, prefill: asyncio.Task[dict[str, Any]], resp: Response,
                      protocol: str) -> None:
        """The decode leg answered (a stream handed over, a whole answer, a 4xx, or 499 for a client
        that left): a prefill leg still running finishes in the background (its deadline bounds it),
        unless nobody listens any more."""
        model = parsed.profile.model
        self.metrics.legs.labels(model, protocol, "decode", _outcome(resp.status_code)).inc()
        if resp.status_code == CLIENT_CLOSED:
            prefill.cancel()
        if prefill.done():
            self._count_prefill(model, protocol, prefill)
            return
        self._background.add(prefill)
        prefill.add_done_callback(lambda t: (self._background.discard(t), self._count_prefill(model, protocol, t)))

    def _count_prefill(self, model: str, protocol: str, t: asyncio.Task[Any]) -> None:
        if t.cancelled():
            outcome = "aborted"
        elif t.exception() is not None:
            exc = t.exception()
            outcome = "stalled" if isinstance(exc, PrefillFailed) and exc.timed_out else "failed"
        else:
            outcome = "ok"
        self.metrics.legs.labels(model, protocol, "prefill", outcome).inc()

    async def _decode_failed(self, parsed: ParsedRequest, prefill: asyncio.Future[Any], pre: Target,
                             dec: Target, f: RetryableFailure, protocol: str) -> None:
        """The decode leg failed before the first byte. When its KV did not come (the decode engine
        says so, or the prefill leg has failed too) the prefill instance is to blame and the decode
        instance may prefill it itself; else the decode instance is out and another one prefills."""
        relay = self.relay
        model = parsed.profile.model
        kv_missing = "KV transfer" in f.detail
        cut_short = not prefill.done()
        if cut_short:
            await cancel_and_wait([prefill])
        prefill_failed = prefill.cancelled() or prefill.exception() is not None
        if kv_missing and cut_short:
            # The decode side could not read the KV (the prefill server died or broke off) before
            # our own prefill leg noticed: that leg failed, it was not aborted on the client's behalf.
            self.metrics.legs.labels(model, protocol, "prefill", "failed").inc()
        elif isinstance(prefill, asyncio.Task):
            self._count_prefill(model, protocol, prefill)
        self.metrics.legs.labels(model, protocol, "decode", "failed").inc()
        relay.metrics.upstream_errors.labels(dec.instance.instance_id, f.kind).inc()
        log.warning("request %s: decode leg on %s failed before its first byte (%s)", parsed.profile.request_id,
                    dec.instance.instance_id, f)
        excluded: list[str] = []
        if prefill_failed or kv_missing:
            relay.state.mark_failed(pre.instance.instance_id, f"prefill leg: the decode side got no KV ({f.kind})")
            excluded.append(pre.instance.instance_id)
        else:
            relay.state.mark_failed(dec.instance.instance_id, str(f))
            excluded.append(dec.instance.instance_id)
        self.metrics.legs.labels(model, protocol, "decode", "retried_local").inc()
        raise SplitFailed(excluded)

    async def close(self) -> None:
        for t in list(self._background):
            await cancel_and_wait([t])


def _outcome(status: int) -> str:
    return "aborted" if status == CLIENT_CLOSED else "ok" if status < 400 else "failed"
