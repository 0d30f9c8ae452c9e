"""The per-request shortcuts of the /v1 path (issue 14, CPU per request) give what the long way gave."""

from __future__ import annotations

import re

from gateway.requests import new_request_id


def test_fresh_request_ids_are_unique_and_shaped_like_before() -> None:
    ids = [new_request_id({}) for _ in range(2000)]
    assert len(set(ids)) == len(ids)
    assert all(re.fullmatch(r"req-[0-9a-f]{32}", i) for i in ids)  # uuid4().hex's shape


def test_a_sane_client_request_id_is_kept_and_an_odd_one_replaced() -> None:
    assert new_request_id({"x-request-id": "trace-42:a.b_c"}) == "trace-42:a.b_c"
    for odd in ("", "has space", "x" * 129, "semi;colon"):
        got = new_request_id({"x-request-id": odd})
        assert got != odd and re.fullmatch(r"req-[0-9a-f]{32}", got)


def test_lookup_headers_answer_as_starlettes_headers() -> None:
    from starlette.datastructures import Headers

    from gateway.fast_path import BufferedRequest, LookupHeaders

    raw = [(b"host", b"h"), (b"authorization", b"Bearer k1"), (b"x-request-id", b"a"),
           (b"x-request-id", b"b"), (b"x-tokenfleet-region", b"\xe9u")]  # a repeated name; a latin-1 byte
    scope = {"type": "http", "headers": raw}
    ours, theirs = LookupHeaders(scope=scope), Headers(scope={"type": "http", "headers": list(raw)})
    names = ["host", "Authorization", "X-Request-Id", "x-tokenfleet-region", "x-tokenfleet-class", "traceparent"]
    for name in names:
        assert ours.get(name) == theirs.get(name)
        assert ours.get(name, "d") == theirs.get(name, "d")
        assert (name in ours) == (name in theirs)
        if name in theirs:
            assert ours[name] == theirs[name]
    assert ours.getlist("x-request-id") == ["a", "b"] and ours.items() == theirs.items() and ours == theirs
    try:
        ours["absent"]
    except KeyError as e:
        assert e.args == ("absent",)
    else:
        raise AssertionError("an absent header must raise KeyError")
    req = BufferedRequest({"type": "http", "headers": raw, "method": "POST", "path": "/v1/completions"},
                          None, b"{}")  # type: ignore[arg-type]
    assert isinstance(req.headers, LookupHeaders) and req.headers.get("authorization") == "Bearer k1"


class _DownAdapter:
    """Only what `InstanceState.up` asks of an adapter: whether the process is known dead."""

    def __init__(self) -> None:
        self.dead: set[str] = set()

    def down(self, instance: object) -> bool:
        return getattr(instance, "instance_id", "") in self.dead


def test_fleet_view_is_rebuilt_whenever_an_input_changes_and_reused_otherwise() -> None:
    from engine_adapters.base import LoadSnapshot
    from gateway.fleet_state import FleetState, InstanceState, build_view
    from tests.conftest import make_config, make_instance

    config = make_config()
    state = FleetState(config, [])
    adapter = _DownAdapter()
    for i, site in enumerate(("use1", "euw1", "use1")):
        inst = make_instance(f"i{i}", f"http://x/{i}", site=site)
        state._states[inst.instance_id] = InstanceState(adapter, inst, ready=True)  # type: ignore[arg-type]

    def check() -> object:
        v = state.view()
        assert v == build_view(config, state._states.values())  # what it always was
        return v

    v0 = check()
    assert state.view() is v0  # nothing changed: the same (immutable) view
    st = state._states["i1"]
    steps = [lambda: state.begin("i1"), lambda: state.end("i1"), lambda: setattr(st, "remote_inflight", 2),
             lambda: setattr(st, "load", LoadSnapshot(True, num_running=3, kv_usage=0.5)),
             lambda: setattr(st, "load", LoadSnapshot(True, num_running=4, kv_usage=0.5)),
             lambda: setattr(st, "draining", True), lambda: setattr(st, "ready", False),
             lambda: adapter.dead.add("i0"), lambda: adapter.dead.discard("i0"),
             lambda: setattr(st, "instance", make_instance("i1", "http://y/1", site="euw1")),
             lambda: state._states.pop("i2")]
    last = v0
    for step in steps:
        step()
        v = check()
        assert v is not last and v != last  # each step changes what the policies see
        assert state.view() is v
        last = v
    st.load = LoadSnapshot(True, num_running=4, kv_usage=0.5)  # a new scrape with the same figures
    assert check() is last


class _Transport:
    """Records writes and closes, as the socket would see them."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        assert not self.closed
        self.writes.append(bytes(data))

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed


def test_head_hold_joins_the_held_write_with_the_next_and_keeps_the_bytes_in_order() -> None:
    from gateway.head_hold import HeadHold

    t = _Transport()
    h = HeadHold(t)  # type: ignore[arg-type]
    h.write(b"a")  # not holding: straight through
    h.hold()
    h.write(b"HEAD")
    assert t.writes == [b"a"]  # kept back
    h.write(b"BODY")
    h.write(b"MORE")
    assert t.writes == [b"a", b"HEADBODY", b"MORE"]  # one write for head and first body; then plain
    h.release()  # nothing held: nothing written
    assert t.writes == [b"a", b"HEADBODY", b"MORE"] and not h.is_closing()


def test_head_hold_writes_what_it_holds_on_release_and_before_closing() -> None:
    from gateway.head_hold import HeadHold

    t = _Transport()
    h = HeadHold(t)  # type: ignore[arg-type]
    h.hold()
    h.write(b"HEAD")
    h.release()
    assert t.writes == [b"HEAD"]
    h.write(b"x")
    assert t.writes == [b"HEAD", b"x"]  # released: no longer holding
    h.hold()
    h.write(b"HEAD2")
    h.close()
    assert t.writes == [b"HEAD", b"x", b"HEAD2"] and t.closed


class _Stats:
    done = True


class _Dispatch:
    stats = _Stats()


class _Stream:
    """What RelayStreamingResponse reads of a RelayStream: its one chunk, prefetched, and its dispatch."""

    def __init__(self) -> None:
        self.d = _Dispatch()
        self._pending = b"data: x\n\n"

    async def iter_bytes(self):  # type: ignore[no-untyped-def]
        chunk, self._pending = self._pending, b""
        yield chunk

    async def close(self) -> None:
        return None


async def test_a_relayed_stream_sends_its_head_and_first_events_in_one_write() -> None:
    from gateway.head_hold import SCOPE_KEY, HeadHold
    from gateway.relay import RelayStreamingResponse

    t = _Transport()
    hold = HeadHold(t)  # type: ignore[arg-type]
    wire: list[bytes] = []

    async def send(message: dict) -> None:  # type: ignore[type-arg]
        # as uvicorn's cycle does: one transport write per message (the head, then each body)
        if message["type"] == "http.response.start":
            hold.write(b"HEAD")
        else:
            hold.write(message["body"] + (b"" if message["more_body"] else b"END"))
        wire.append(message["type"])

    async def receive() -> dict:  # type: ignore[type-arg]
        return {"type": "http.request", "body": b"", "more_body": False}

    resp = RelayStreamingResponse(_Stream(), {"x-request-id": "r"})  # type: ignore[arg-type]
    await resp({"type": "http", SCOPE_KEY: hold}, receive, send)
    assert wire == ["http.response.start", "http.response.body"]
    assert t.writes == [b"HEADdata: x\n\nEND"]  # head and the first (here: last) chunk together

    t2 = _Transport()
    resp2 = RelayStreamingResponse(_Stream(), {})  # type: ignore[arg-type]
    hold = HeadHold(t2)  # type: ignore[arg-type]
    await resp2({"type": "http"}, receive, send)  # no hold in the scope (another server): as before
    assert t2.writes == [b"HEAD", b"data: x\n\nEND"]


async def test_a_finished_stream_is_freed_without_the_cyclic_collector() -> None:
    # Telemetry's `on_done` reads the response's status: a closure over the response, stored on
    # it. The response drops it once run, so the stream's state goes with the last reference
    # instead of waiting, promoted through the generations, for a collection.
    import gc
    import weakref

    from gateway.relay import RelayStreamingResponse

    async def send(message: dict) -> None:  # type: ignore[type-arg]
        return None

    async def receive() -> dict:  # type: ignore[type-arg]
        return {"type": "http.request", "body": b"", "more_body": False}

    ran: list[int] = []
    gc.disable()
    try:
        resp = RelayStreamingResponse(_Stream(), {})  # type: ignore[arg-type]
        resp.on_done = lambda: ran.append(resp.status_code)  # the cycle telemetry makes
        await resp({"type": "http"}, receive, send)
        assert ran == [200] and resp.on_done is None
        gone = weakref.ref(resp)
        del resp
        assert gone() is None  # freed by its reference count alone
    finally:
        gc.enable()
