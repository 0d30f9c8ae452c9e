"""Another replica's dispatch, heard late (`InstanceRouter.note_dispatch` / `note_release`): what the
routers book for it, and the route-share records that carry it between live replicas."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from fleetcore.policies import InstanceRouter
from fleetcore.replica_spread import ReplicaSlot, SpreadRouter
from fleetcore.types import InstanceSnapshot, RequestProfile, RouteDecision
from fleetsim.cli import make_policy
from gateway import route_share
from gateway.route_share import DISPATCH, END, FIRST_TOKEN, RouteShare, decode, encode_dispatch, encode_mark
from tests.test_fleetsim import small_fleet
from tokenpilot.router import TokenPilot

SNAP = InstanceSnapshot(instance_id="i0", site="s1", model="m", version="v", url="http://i0", num_running=3,
                        kv_usage=0.4)


def _profile(rid: str, stream: bool = True, prompt: int = 3000) -> RequestProfile:
    return RequestProfile(request_id=rid, model="m", prompt_tokens=prompt, block_hashes=tuple(range(100, 180)),
                          max_tokens=64, stream=stream)


def test_tokenpilot_books_a_remote_dispatch_exactly_as_its_own_route_there() -> None:
    own, heard = TokenPilot(), TokenPilot()
    for stream in (True, False):
        p = _profile(f"r{stream}", stream)
        assert own.route(p, [SNAP], 1.0).instance_id == "i0"
        heard.note_dispatch(p, SNAP, 1.0)
        assert heard.explain("i0") == own.explain("i0")
        # every state row, the forward model's token rows included (NaN: a step fit not in yet, on both)
        assert np.array_equal(heard._s.m, own._s.m, equal_nan=True)
    assert heard.cache_blocks("i0") == own.cache_blocks("i0") > 0  # history mode: the prefix it will cache
    assert len(heard.decisions) == 0  # not a decision of this replica


def test_its_first_token_and_its_release_undo_the_booking_and_teach_nothing() -> None:
    r = TokenPilot()
    before = r.explain("i0")
    r.note_dispatch(_profile("x"), SNAP, 1.0)
    e = r.explain("i0")
    assert e["streams"] == 1 and e["outstanding"] == 1 and e["backlog_s"] > 0
    r.on_first_token("x", 1.2)
    e = r.explain("i0")
    assert e["outstanding"] == 0 and e["streams"] == 1
    r.note_release("x", 1.5)
    e = r.explain("i0")
    assert e["streams"] == 0 and e["prefill_speed_factor"] == before["prefill_speed_factor"]
    r.note_release("x", 1.6)  # twice, or a release never booked: nothing
    r.note_release("never", 1.6)
    assert r.explain("i0")["streams"] == 0


def test_a_peer_learns_the_remote_prefix_and_nothing_else() -> None:
    fleet = small_fleet(instances=2)
    for name in ("sglang_cache_aware", "dynamo_kv", "llm_d", "aibrix_prefix"):
        peer = make_policy(name, 0, fleet)
        snaps = [SNAP, InstanceSnapshot(instance_id="i1", site="s1", model="m", version="v", url="http://i1")]
        assert peer.prefix_match(_profile("a"), snaps, 1.0) == [0, 0]
        peer.note_dispatch(_profile("a"), SNAP, 1.0)
        assert peer.prefix_match(_profile("b"), snaps, 1.0) == [80, 0], name
        peer.note_release("a", 2.0)


class _Recorder(InstanceRouter):
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def route(self, profile: RequestProfile, candidates: Sequence[InstanceSnapshot], now: float) -> RouteDecision:
        return RouteDecision(candidates[0].instance_id, "first")

    def note_dispatch(self, profile: RequestProfile, instance: InstanceSnapshot, now: float) -> None:
        self.calls.append(("dispatch", profile, instance.instance_id, now))

    def on_first_token(self, request_id: str, now: float) -> None:
        self.calls.append(("first", request_id, now))

    def note_release(self, request_id: str, now: float) -> None:
        self.calls.append(("release", request_id, now))

    def refit_due(self) -> bool:
        return True

    def refit(self) -> bool:
        self.calls.append(("refit",))
        return True


def test_the_replica_wrapper_passes_every_one_of_them_on() -> None:
    inner = _Recorder()
    s = SpreadRouter(inner, ReplicaSlot(2, 1))
    s.note_dispatch(_profile("a"), SNAP, 1.0)
    s.on_first_token("a", 2.0)  # was swallowed: TokenPilot behind the wrapper never saw a first token
    s.note_release("a", 3.0)
    assert s.refit_due() and s.refit()
    assert [c[0] for c in inner.calls] == ["dispatch", "first", "release", "refit"]


def test_records_round_trip_and_malformed_ones_are_skipped() -> None:
    p = RequestProfile(request_id="q1", model="m", prompt_tokens=900, block_hashes=tuple(range(1000)),
                       block_size=32, max_tokens=None, stream=True)
    rec = decode(encode_dispatch(p, "i3", "ra"))
    assert rec is not None and (rec.replica, rec.kind, rec.key, rec.instance_id) == ("ra", DISPATCH, "q1", "i3")
    assert (rec.prompt_tokens, rec.max_tokens, rec.stream, rec.block_size) == (900, None, True, 32)
    assert rec.block_hashes == tuple(range(route_share.MAX_BLOCKS))  # only the leading blocks travel
    end = decode(encode_mark(END, "q1", "ra"))
    assert end is not None and (end.kind, end.key) == (END, "q1")
    good = encode_dispatch(p, "i3", "ra")
    for bad in ({}, {**good, "k": "x"}, {**good, "p": "many"}, {**good, "p": "-1"}, {**good, "b": "0"},
                {**good, "h": "1,a"}, {k: v for k, v in good.items() if k != "i"}, {"r": "ra", "k": END}):
        assert decode(bad) is None, bad


class _Shared:
    replica_id = "rb"


def _share(router: InstanceRouter) -> RouteShare:
    known = {"i0": SNAP}
    return RouteShare(_Shared(), router, lambda: 0.0, 0.1, known.get)  # type: ignore[arg-type]


def _hear(rs: RouteShare, fields: dict[str, str], now: float) -> int:
    rec = decode(fields)
    assert rec is not None
    return rs._hear(rec, now)


def test_heard_records_reach_the_router_namespaced_and_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    r = _Recorder()
    rs = _share(r)
    assert _hear(rs, encode_mark(FIRST_TOKEN, "q", "ra"), 0.0) == 0  # nothing booked for it: not passed on
    assert _hear(rs, encode_dispatch(_profile("q"), "i0", "ra"), 1.0) == 1
    assert _hear(rs, encode_dispatch(_profile("z"), "unknown", "ra"), 1.0) == 0  # not in this fleet
    _hear(rs, encode_mark(FIRST_TOKEN, "q", "ra"), 1.1)
    _hear(rs, encode_mark(END, "q", "ra"), 1.2)
    _hear(rs, encode_mark(END, "q", "ra"), 1.3)  # a second end: nothing left to release
    kinds = [(c[0], c[1].request_id if c[0] == "dispatch" else c[1]) for c in r.calls]
    assert kinds == [("dispatch", "ra/q"), ("first", "ra/q"), ("release", "ra/q")]
    dispatch = r.calls[0][1]
    assert (dispatch.prompt_tokens, dispatch.max_tokens, dispatch.stream, dispatch.model) == (3000, 64, True, "m")

    monkeypatch.setattr(route_share, "MAX_REMOTE", 3)
    r.calls.clear()
    for i in range(5):
        _hear(rs, encode_dispatch(_profile(f"n{i}"), "i0", "ra"), 2.0 + i)
    assert [c[1] for c in r.calls if c[0] == "release"] == ["ra/n0", "ra/n1"]  # the oldest go first
    assert list(rs.booked) == ["ra/n2", "ra/n3", "ra/n4"]
    r.calls.clear()
    rs._expire(5.0 + route_share.REMOTE_TTL_S + 0.5)  # n2 and n3 heard over the TTL ago: no release will come
    assert [c[1] for c in r.calls] == ["ra/n2", "ra/n3"]
    rs.release_all()  # Redis gone
    assert rs.booked == {} and r.calls[-1] == ("release", "ra/n4", 0.0)


def test_a_retry_heard_is_rebooked_not_counted_twice() -> None:
    tp = TokenPilot()
    rs = _share(tp)
    _hear(rs, encode_dispatch(_profile("q"), "i0", "ra"), 1.0)
    _hear(rs, encode_dispatch(_profile("q"), "i0", "ra"), 1.1)  # the same request routed again
    assert tp.explain("i0")["streams"] == 1 and len(rs.booked) == 1
    _hear(rs, encode_mark(END, "q", "ra"), 1.2)
    assert tp.explain("i0")["streams"] == 0
