"""Observability of the serving path: OpenTelemetry traces and metrics, the access log, SLO misses.

One `RequestRecord` per client request follows it from the handler (`app._serve`) through
admission (`AdmissionGate.enter`) and every engine attempt (`Relay._dispatch`, `Dispatch.finish`)
to its end (the response built, or the stream over). Its end is the single place where a
request's figures are written: the access log line, the Prometheus histograms by class,
the OTel instruments and spans, the missed-SLO ring — one source of truth for all of them.

Traces (configured by the standard `OTEL_*` variables; off when none asks for them):
a SERVER span per request, continuing the client's W3C `traceparent`, and a CLIENT span
per engine attempt, whose context goes upstream as `traceparent`. Off, no tracer exists
and no span object is ever made; the client's own `traceparent` is still passed to the
engine unchanged, so an engine that traces stays in the client's trace.

Metrics: `gen_ai.server.time_to_first_token`, `gen_ai.server.time_per_output_token`,
`gen_ai.server.request.duration`, `gen_ai.client.token.usage`, `tokenfleet.queue.wait` and
`tokenfleet.slo.requests` (attainment = met / all, per class) go out by OTLP when metrics
export is configured; TTFT, TPOT and queue wait by class are on `/metrics` always
(`gen_ai_server_time_to_first_token_seconds{model,class,tenant}` and friends; the public
view sums the tenant away, as for every other series).

The OpenTelemetry packages are imported only when a signal is on.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry

from fleetcore.slo import ClassSLO
from fleetcore.types import RequestOutcome, RequestProfile
from gateway.logs import emit
from gateway.metrics import LabelledHistogram, child_of
from gateway.slo_log import Finished, SLOLog

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, Tracer
    from starlette.responses import Response

    from engine_adapters.base import Instance
    from fleetcore.types import RouteDecision

access_log = logging.getLogger("tokenfleet.access")
log = logging.getLogger("tokenfleet.gateway")

OPERATION = {"chat": "chat", "completion": "text_completion"}
PROVIDER = "tokenfleet"
# The OTel GenAI semantic conventions' advised bucket boundaries.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
DURATION_BUCKETS = tuple(round(0.01 * 2 ** i, 2) for i in range(14))  # 0.01 .. 81.92
TOKEN_BUCKETS = tuple(float(4 ** i) for i in range(14))  # 1 .. 67,108,864
QUEUE_BUCKETS = TTFT_BUCKETS  # a queue wait is part of TTFT: same resolution
TRACEPARENT, TRACESTATE = "traceparent", "tracestate"
EXPORT_SHUTDOWN_S = 3.0  # flushing spans and metrics at shutdown: never longer than this


# --- configuration from the environment -------------------------------------------------

def signal_enabled(env: Mapping[str, str], signal: str) -> bool:
    """Is `signal` ("traces" / "metrics") asked for by the standard OTel variables? An explicit
    `OTEL_<SIGNAL>_EXPORTER` decides ("none" is off); otherwise an OTLP endpoint turns it on.
    Unlike the SDK's own default (otlp to localhost), nothing set means off."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporter = env.get(f"OTEL_{signal.upper()}_EXPORTER", "").strip().lower()
    if exporter:
        return exporter != "none"
    return bool(env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get(f"OTEL_EXPORTER_OTLP_{signal.upper()}_ENDPOINT"))


def _exporter_names(env: Mapping[str, str], signal: str) -> list[str]:
    raw = env.get(f"OTEL_{signal.upper()}_EXPORTER", "").strip().lower() or "otlp"
    return [n.strip() for n in raw.split(",") if n.strip() and n.strip() != "none"]


def _protocol(env: Mapping[str, str], signal: str) -> str:
    return (env.get(f"OTEL_EXPORTER_OTLP_{signal.upper()}_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
            or "http/protobuf").strip().lower()


def _otlp_module(env: Mapping[str, str], signal: str) -> str:
    proto = _protocol(env, signal)
    kind = "trace_exporter" if signal == "traces" else "metric_exporter"
    if proto == "http/protobuf":
        return f"opentelemetry.exporter.otlp.proto.http.{kind}"
    if proto == "grpc":
        return f"opentelemetry.exporter.otlp.proto.grpc.{kind}"
    raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL must be http/protobuf or grpc; got {proto!r}")


def _load_exporter(env: Mapping[str, str], signal: str, name: str) -> Any:
    import importlib

    if name == "console":
        if signal == "traces":
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter
            return ConsoleSpanExporter()
        from opentelemetry.sdk.metrics.export import ConsoleMetricExporter
        return ConsoleMetricExporter()
    if name != "otlp":
        raise ValueError(f"OTEL_{signal.upper()}_EXPORTER: only otlp, console or none are supported; got {name!r}")
    module = _otlp_module(env, signal)
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise ValueError(f"{module} is not installed (pip install opentelemetry-exporter-otlp-proto-"
                         f"{'grpc' if 'grpc' in module else 'http'}): {e}") from None
    # The endpoint from `env` (the SDK would read only the process environment); headers,
    # timeout and compression the exporters read from OTEL_* themselves.
    endpoint = _endpoint(env, signal, "grpc" in module)
    cls = mod.OTLPSpanExporter if signal == "traces" else mod.OTLPMetricExporter
    return cls(endpoint=endpoint) if endpoint else cls()


def _endpoint(env: Mapping[str, str], signal: str, grpc: bool) -> str | None:
    """The spec's resolution: the signal's own endpoint as given; else the base one (+ /v1/<signal> for HTTP)."""
    own = env.get(f"OTEL_EXPORTER_OTLP_{signal.upper()}_ENDPOINT", "").strip()
    if own:
        return own
    base = env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
    if not base or grpc:
        return base or None
    return f"{base.rstrip('/')}/v1/{signal}"


def _resource(env: Mapping[str, str]) -> Any:
    from opentelemetry.sdk.resources import Resource
    # OTEL_RESOURCE_ATTRIBUTES (read by the SDK) adds to it; OTEL_SERVICE_NAME names the service.
    return Resource.create({"service.name": env.get("OTEL_SERVICE_NAME") or "tokenfleet-gateway"})


def tracer_provider_from_env(env: Mapping[str, str]) -> TracerProvider | None:
    if not signal_enabled(env, "traces"):
        return None
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    # The sampler comes from OTEL_TRACES_SAMPLER (default: parent-based, always on). The batch
    # processor's queue is bounded (OTEL_BSP_MAX_QUEUE_SIZE, 2048): spans beyond it are dropped.
    provider = TracerProvider(resource=_resource(env))
    for name in _exporter_names(env, "traces"):
        provider.add_span_processor(BatchSpanProcessor(_load_exporter(env, "traces", name)))
    return provider


def meter_provider_from_env(env: Mapping[str, str]) -> MeterProvider | None:
    if not signal_enabled(env, "metrics"):
        return None
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    # The export interval comes from OTEL_METRIC_EXPORT_INTERVAL (default 60 s).
    readers = [PeriodicExportingMetricReader(_load_exporter(env, "metrics", n)) for n in _exporter_names(env, "metrics")]
    return MeterProvider(metric_readers=readers, resource=_resource(env))


# --- the per-class histograms on /metrics ------------------------------------------------

class ClassHistograms:
    """TTFT, TPOT and queue wait by model x class x tenant on the gateway's Prometheus registry.
    The tenant label is summed away on the public /metrics (`gateway.metrics`)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ["model", "class", "tenant"]
        self.ttft = LabelledHistogram("gen_ai_server_time_to_first_token_seconds", "Time to first token by class",
                                      labels, buckets=TTFT_BUCKETS, registry=registry)
        self.tpot = LabelledHistogram("gen_ai_server_time_per_output_token_seconds",
                                      "Mean time per output token by class", labels, buckets=TPOT_BUCKETS,
                                      registry=registry)
        self.queue_wait = LabelledHistogram("tokenfleet_queue_wait_seconds", "Time spent in admission's class queue",
                                            labels, buckets=QUEUE_BUCKETS, registry=registry)
        # Labelled children per histogram (`gateway.metrics.child_of`: three lookups a request).
        self._ttft: dict[tuple[str, str, str], Any] = {}
        self._tpot: dict[tuple[str, str, str], Any] = {}
        self._queue_wait: dict[tuple[str, str, str], Any] = {}

    def observe(self, key: tuple[str, str, str], ttft: float | None, tpot: float | None,
                queue_wait: float | None) -> None:
        """One request's figures (None: not measured) under (model, class, tenant)."""
        if ttft is not None:
            child_of(self._ttft, self.ttft, key).observe(ttft)
        if tpot is not None:
            child_of(self._tpot, self.tpot, key).observe(tpot)
        if queue_wait is not None:
            child_of(self._queue_wait, self.queue_wait, key).observe(queue_wait)


class _Instruments:
    """The OTel instruments (only when metrics export is on)."""

    def __init__(self, provider: MeterProvider) -> None:
        m = provider.get_meter("tokenfleet.gateway")
        self.ttft = m.create_histogram("gen_ai.server.time_to_first_token", unit="s",
                                       description="Time to generate the first token",
                                       explicit_bucket_boundaries_advisory=TTFT_BUCKETS)
        self.tpot = m.create_histogram("gen_ai.server.time_per_output_token", unit="s",
                                       description="Time per output token after the first",
                                       explicit_bucket_boundaries_advisory=TPOT_BUCKETS)
        self.duration = m.create_histogram("gen_ai.server.request.duration", unit="s",
                                           description="Generative AI server request duration",
                                           explicit_bucket_boundaries_advisory=DURATION_BUCKETS)
        self.tokens = m.create_histogram("gen_ai.client.token.usage", unit="{token}",
                                         description="Tokens used per request, by type",
                                         explicit_bucket_boundaries_advisory=TOKEN_BUCKETS)
        self.queue_wait = m.create_histogram("tokenfleet.queue.wait", unit="s",
                                             description="Time spent in admission's class queue",
                                             explicit_bucket_boundaries_advisory=QUEUE_BUCKETS)
        self.slo = m.create_counter("tokenfleet.slo.requests", unit="{request}",
                                    description="Requests that reached admission, by class and whether they met the SLO")


# --- the hub -----------------------------------------------------------------------------

SLOLookup = Callable[[str, str], ClassSLO]


class Telemetry:
    def __init__(self, registry: CollectorRegistry, *, clock: Callable[[], float] = time.monotonic,
                 slo_of: SLOLookup | None = None, tracer_provider: TracerProvider | None = None,
                 meter_provider: MeterProvider | None = None, slo_log: SLOLog | None = None) -> None:
        self.clock = clock
        self.slo_of = slo_of
        self.tracer_provider = tracer_provider
        self.meter_provider = meter_provider
        self.tracer: Tracer | None = None
        if tracer_provider is not None:
            from opentelemetry import trace
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
            self.tracer = tracer_provider.get_tracer("tokenfleet.gateway")
            self.propagator = TraceContextTextMapPropagator()
            self.in_context = trace.set_span_in_context
            self.kinds = trace.SpanKind
            self.error_status = trace.Status(trace.StatusCode.ERROR)
        self.otel = _Instruments(meter_provider) if meter_provider is not None else None
        self.prom = ClassHistograms(registry)
        self.slo_log = slo_log if slo_log is not None else SLOLog()

    @classmethod
    def from_env(cls, env: Mapping[str, str], registry: CollectorRegistry, **kw: Any) -> Telemetry:
        return cls(registry, tracer_provider=tracer_provider_from_env(env),
                   meter_provider=meter_provider_from_env(env), **kw)

    def begin(self, headers: Mapping[str, str], kind: str, request_id: str) -> RequestRecord:
        span = None
        parent = headers.get(TRACEPARENT)
        if self.tracer is not None:
            carrier = {TRACEPARENT: parent or "", TRACESTATE: headers.get(TRACESTATE, "")}
            ctx = self.propagator.extract(carrier) if parent else None
            span = self.tracer.start_span(OPERATION.get(kind, kind), context=ctx, kind=self.kinds.SERVER)
        return RequestRecord(self, kind, request_id, self.clock(), parent, headers.get(TRACESTATE), span)

    async def serve(self, rec: RequestRecord, work: Awaitable[Response]) -> Response:
        """Await the relay; end `rec` when the response is built or, for a stream, once it is over."""
        try:
            resp = await work
        except BaseException as e:
            status = getattr(e, "status", None)
            rec.end(int(status) if isinstance(status, int) else 500, error=getattr(e, "message", None) or type(e).__name__)
            raise
        on_done = getattr(resp, "on_done", False)
        if on_done is False:  # not a relayed stream: it is over now
            rec.end(resp.status_code)
            return resp

        def done(prev: Callable[[], None] | None = on_done) -> None:
            try:
                if prev is not None:
                    prev()
            finally:
                rec.end(resp.status_code)
        resp.on_done = done  # type: ignore[attr-defined]
        return resp

    async def shutdown(self) -> None:
        """Flush what is buffered and stop the exporters, within EXPORT_SHUTDOWN_S (they block)."""
        providers = [p for p in (self.tracer_provider, self.meter_provider) if p is not None]
        if not providers:
            return

        def stop() -> None:
            for p in providers:
                try:
                    p.shutdown()
                except Exception:
                    log.exception("telemetry exporter shutdown failed")
        try:
            await asyncio.wait_for(asyncio.to_thread(stop), EXPORT_SHUTDOWN_S)
        except asyncio.TimeoutError:
            log.warning("telemetry exporters did not flush within %.0f s; dropping what is left", EXPORT_SHUTDOWN_S)


# --- one request -------------------------------------------------------------------------

class RequestRecord:
    """What the gateway learns about one request, filled in as it goes; `end` writes it out once."""

    __slots__ = ("tel", "kind", "request_id", "started", "traceparent", "tracestate", "span", "attempt_span",
                 "profile", "tenant", "admission", "admission_code", "queue_wait_s", "attempts", "site",
                 "site_reason", "instance", "served_model", "provider", "predicted_ttft_s", "cached_estimate",
                 "outcome", "attempt_status", "finish_reasons", "ended")

    def __init__(self, tel: Telemetry, kind: str, request_id: str, started: float, traceparent: str | None,
                 tracestate: str | None, span: Span | None) -> None:
        self.tel = tel
        self.kind = kind
        self.request_id = request_id
        self.started = started
        self.traceparent = traceparent  # the client's, forwarded as is when tracing is off
        self.tracestate = tracestate
        self.span = span
        self.attempt_span: Span | None = None
        self.profile: RequestProfile | None = None
        self.tenant: str | None = None
        self.admission: str | None = None  # admitted / queued / rejected / left (the client, while queued)
        self.admission_code: str | None = None
        self.queue_wait_s: float | None = None
        self.attempts = 0
        self.site: str | None = None
        self.site_reason: str | None = None
        self.instance: str | None = None
        self.served_model: str | None = None
        self.provider: str | None = None
        self.predicted_ttft_s: float | None = None
        self.cached_estimate: int | None = None
        self.outcome: RequestOutcome | None = None
        self.attempt_status: str | None = None
        self.finish_reasons: tuple[str, ...] = ()
        self.ended = False

    # -- hooks ----------------------------------------------------------------------------

    def parsed(self, profile: RequestProfile) -> None:
        self.profile = profile
        self.tenant = profile.tenant
        if self.span is not None:
            self.span.update_name(f"{OPERATION.get(self.kind, self.kind)} {profile.model}")

    def admitted(self, action: str, waited_s: float, profile: RequestProfile, code: str | None = None) -> None:
        """Admission's verdict (`action`), the time it held the request, the class it gave."""
        self.admission = action
        self.admission_code = code
        self.queue_wait_s = waited_s
        self.profile = profile

    def attempt(self, site: str, site_reason: str, instance: Instance, route: RouteDecision | None) -> None:
        """An engine attempt starts: its CLIENT span (tracing on) becomes what goes upstream."""
        self.attempts += 1
        self.site, self.site_reason, self.instance = site, site_reason, instance.instance_id
        self.served_model, self.provider = instance.model, instance.adapter
        self.predicted_ttft_s = route.predicted_ttft_s if route is not None else None
        self.cached_estimate = route.cached_tokens if route is not None else None
        tel = self.tel
        if tel.tracer is None or self.span is None or not self.span.is_recording():
            return  # not traced, or not sampled: `inject` passes the request's context on as it is
        model = self.profile.model if self.profile is not None else ""
        op = OPERATION.get(self.kind, self.kind)
        self.attempt_span = tel.tracer.start_span(
            f"{op} {model}", context=tel.in_context(self.span), kind=tel.kinds.CLIENT,
            attributes={"gen_ai.operation.name": op, "gen_ai.provider.name": instance.adapter,
                        "gen_ai.request.model": model, "tokenfleet.site": site,
                        "tokenfleet.instance": instance.instance_id, "tokenfleet.attempt": self.attempts,
                        **({"tokenfleet.predicted_ttft_s": self.predicted_ttft_s}
                           if self.predicted_ttft_s is not None else {})})

    def inject(self, headers: dict[str, str]) -> None:
        """The trace context for the engine: this attempt's span, or the client's own header."""
        tel = self.tel
        span = self.attempt_span or self.span  # the server span: a request the sampler left out
        if span is not None:
            tel.propagator.inject(headers, context=tel.in_context(span))
        elif self.traceparent:
            headers[TRACEPARENT] = self.traceparent
            if self.tracestate:
                headers[TRACESTATE] = self.tracestate

    def whole_body(self, body: bytes) -> None:
        """A whole (non-streamed) answer: its choices' finish reasons, parsed only when it is traced."""
        if self.attempt_span is None:
            return
        try:
            obj = json.loads(body)
        except ValueError:
            return
        choices = obj.get("choices") if isinstance(obj, dict) else None
        if isinstance(choices, list):
            self.finish_reasons = tuple(str(c["finish_reason"]) for c in choices
                                        if isinstance(c, dict) and c.get("finish_reason"))

    def attempt_ended(self, outcome: RequestOutcome, status: str | None,
                      finish_reasons: tuple[str, ...] | None) -> None:
        """`finish_reasons` None: the stream showed none (a whole answer's came by `whole_body`)."""
        self.outcome = outcome
        self.attempt_status = status
        if finish_reasons is not None:
            self.finish_reasons = finish_reasons
        span, self.attempt_span = self.attempt_span, None
        if span is not None:
            span.set_attributes(_usage_attrs(outcome, self.served_model, finish_reasons))
            span.set_attribute("tokenfleet.attempt_status", status or "not answered")
            if not outcome.ok:
                span.set_status(self.tel.error_status)
                span.set_attribute("error.type", _error_type(outcome, status))
            span.end()

    # -- the end --------------------------------------------------------------------------

    def end(self, http_status: int, error: str | None = None) -> None:
        if self.ended:
            return
        self.ended = True
        try:
            self._write(http_status, error)
        except Exception:  # telemetry must never fail a request
            log.exception("request %s: telemetry failed", self.request_id)

    def _write(self, http_status: int, error: str | None) -> None:
        tel = self.tel
        now = tel.clock()
        o, p = self.outcome, self.profile
        status = self.attempt_status if (o is not None and http_status < 300 and self.attempt_status) else str(http_status)
        outcome = _outcome_name(self, status, o)
        cls = p.request_class if p is not None else None
        slo_met: bool | None = None
        reason: str | None = None
        if self.admission is not None and cls is not None and p is not None:  # it counts for goodput
            slo = tel.slo_of(p.tenant, cls) if tel.slo_of is not None else ClassSLO()
            reason = _miss_reason(self, outcome, o, slo, p)
            slo_met = reason is None
        ttft = o.ttft_s if o is not None else None
        tpot = o.mean_tpot_s if o is not None else None
        duration = now - self.started
        model = p.model if p is not None else None
        level = logging.WARNING if outcome == "failed" else logging.INFO
        if access_log.isEnabledFor(level):  # the line's dict is built only when someone reads it
            fields: dict[str, Any] = {
                "request_id": self.request_id, "tenant": self.tenant, "class": cls, "model": model,
                "op": OPERATION.get(self.kind, self.kind), "status": status, "outcome": outcome,
                "site": self.site, "instance": self.instance, "attempts": self.attempts,
                "ttft_ms": _ms(ttft), "tpot_ms": _ms(tpot), "queue_ms": _ms(self.queue_wait_s),
                "duration_ms": _ms(duration),
                "tokens_in": o.prompt_tokens if o is not None else (p.prompt_tokens if p is not None else None),
                "tokens_out": o.output_tokens if o is not None else None,
                "tokens_cached": o.cached_tokens if o is not None else None,
                "admission": self.admission, "slo_met": slo_met, "reason": reason,
                "error": error or (o.error if o is not None and not o.ok else None)}
            emit(access_log, level, fields)
        if cls is not None and model is not None and p is not None:
            self._metrics(model, cls, p.tenant, ttft, tpot, duration, o, slo_met, outcome)
            if slo_met is not None:
                tel.slo_log.add(Finished(now, self.request_id, p.tenant, cls, model, status, outcome, self.site,
                                         self.instance, ttft, tpot, self.queue_wait_s, duration, slo_met, reason))
        if self.span is not None:
            if self.span.is_recording():  # attributes cost ~4 us each: none for an unsampled span
                self._end_span(status, outcome, cls, slo_met, o)
            else:
                self.span.end()

    def _metrics(self, model: str, cls: str, tenant: str, ttft: float | None, tpot: float | None, duration: float,
                 o: RequestOutcome | None, slo_met: bool | None, outcome: str) -> None:
        self.tel.prom.observe((model, cls, tenant), ttft, tpot, self.queue_wait_s)
        ins = self.tel.otel
        if ins is None:
            return
        attrs: dict[str, Any] = {"gen_ai.operation.name": OPERATION.get(self.kind, self.kind),
                                 "gen_ai.provider.name": PROVIDER, "gen_ai.request.model": model,
                                 "tokenfleet.class": cls, "tokenfleet.tenant": tenant}
        if self.served_model is not None:
            attrs["gen_ai.response.model"] = self.served_model
        if ttft is not None:
            ins.ttft.record(ttft, attrs)
        if tpot is not None:
            ins.tpot.record(tpot, attrs)
        if self.queue_wait_s is not None:
            ins.queue_wait.record(self.queue_wait_s, attrs)
        ins.duration.record(duration, attrs if outcome == "ok" else {**attrs, "error.type": outcome})
        if o is not None and o.ok:
            ins.tokens.record(o.prompt_tokens, {**attrs, "gen_ai.token.type": "input"})
            ins.tokens.record(o.output_tokens, {**attrs, "gen_ai.token.type": "output"})
        if slo_met is not None:
            ins.slo.add(1, {"gen_ai.request.model": model, "tokenfleet.class": cls, "tokenfleet.tenant": tenant,
                            "tokenfleet.slo_met": slo_met})

    def _end_span(self, status: str, outcome: str, cls: str | None, slo_met: bool | None,
                  o: RequestOutcome | None) -> None:
        span = self.span
        assert span is not None
        p = self.profile
        attrs: dict[str, Any] = {"gen_ai.operation.name": OPERATION.get(self.kind, self.kind),
                                 "gen_ai.provider.name": PROVIDER, "tokenfleet.request_id": self.request_id,
                                 "tokenfleet.status": status, "tokenfleet.outcome": outcome,
                                 "tokenfleet.retries": max(0, self.attempts - 1)}
        optional: dict[str, Any] = {
            "gen_ai.request.model": p.model if p is not None else None,
            "tokenfleet.tenant": self.tenant, "tokenfleet.class": cls,
            "tokenfleet.admission": self.admission, "tokenfleet.admission_code": self.admission_code,
            "tokenfleet.queue_wait_s": self.queue_wait_s, "tokenfleet.site": self.site,
            "tokenfleet.site_reason": self.site_reason, "tokenfleet.instance": self.instance,
            "tokenfleet.predicted_ttft_s": self.predicted_ttft_s,
            "tokenfleet.cached_tokens_estimate": self.cached_estimate, "tokenfleet.slo_met": slo_met}
        attrs.update((k, v) for k, v in optional.items() if v is not None)
        if o is not None:
            attrs.update(_usage_attrs(o, self.served_model, self.finish_reasons))
            attrs["tokenfleet.cached_tokens"] = o.cached_tokens
            if o.ttft_s is not None:
                attrs["tokenfleet.ttft_s"] = o.ttft_s
            if o.mean_tpot_s is not None:
                attrs["tokenfleet.tpot_s"] = o.mean_tpot_s
        span.set_attributes(attrs)
        if outcome not in ("ok", "cancelled"):
            span.set_status(self.tel.error_status)
            span.set_attribute("error.type", outcome)
        span.end()


def _usage_attrs(o: RequestOutcome, served_model: str | None, finish_reasons: tuple[str, ...]) -> dict[str, Any]:
    attrs: dict[str, Any] = {"gen_ai.usage.input_tokens": o.prompt_tokens,
                             "gen_ai.usage.output_tokens": o.output_tokens,
                             "gen_ai.usage.cache_read.input_tokens": o.cached_tokens}
    if served_model is not None:
        attrs["gen_ai.response.model"] = served_model
    if finish_reasons:
        attrs["gen_ai.response.finish_reasons"] = list(finish_reasons)
    return attrs


def _error_type(o: RequestOutcome, status: str | None) -> str:
    if o.cancelled:
        return "cancelled"
    return status if status and not status.startswith("2") else "upstream_error"


def _ms(s: float | None) -> float | None:
    return None if s is None else round(s * 1000, 2)


def _outcome_name(rec: RequestRecord, status: str, o: RequestOutcome | None) -> str:
    if status in ("401", "403"):
        return "auth_failed"
    if rec.admission == "rejected":
        return "rejected"
    if status == "499" or (o is not None and o.cancelled) or rec.admission == "left":
        return "cancelled"
    if status.isdigit() and int(status) < 400:
        return "ok" if o is None or o.ok else "failed"
    if status.isdigit() and int(status) < 500:
        return "client_error"
    return "failed"


def _miss_reason(rec: RequestRecord, outcome: str, o: RequestOutcome | None, slo: ClassSLO,
                 p: RequestProfile) -> str | None:
    """None when the request met its class SLO (and deadline); else why not, for the operator."""
    if outcome == "rejected":
        return f"rejected by admission ({rec.admission_code or 'rejected'})"
    if outcome == "cancelled":
        return "cancelled by the client"
    if outcome != "ok" or o is None:
        return f"not completed ({outcome}{': ' + o.error if o is not None and o.error else ''})"
    # as slomax.admission.met_slo: a whole (non-streamed) answer's first token is its end
    ttft = o.ttft_s if o.ttft_s is not None else o.e2e_s
    why = []
    if slo.ttft_s is not None and (ttft is None or ttft > slo.ttft_s):
        why.append(f"ttft {ttft if ttft is not None else float('nan'):.3f} s > {slo.ttft_s:g} s")
    if slo.tpot_s is not None and o.mean_tpot_s is not None and o.mean_tpot_s > slo.tpot_s:
        why.append(f"tpot {o.mean_tpot_s * 1000:.1f} ms > {slo.tpot_s * 1000:g} ms")
    if slo.deadline_s is not None and (o.e2e_s is None or o.e2e_s > slo.deadline_s):
        why.append(f"duration {o.e2e_s or 0:.1f} s > class deadline {slo.deadline_s:g} s")
    if p.deadline is not None and (o.e2e_s is None or p.arrival + o.e2e_s > p.deadline + 1e-9):
        why.append("past the request's own deadline")
    if rec.queue_wait_s and why:
        why.append(f"queued {rec.queue_wait_s * 1000:.0f} ms")
    return "; ".join(why) or None
