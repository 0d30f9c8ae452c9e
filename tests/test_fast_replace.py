"""fleetcore.fast_replace.replace is dataclasses.replace: the same object, the same errors."""

from __future__ import annotations

import dataclasses
from dataclasses import InitVar, dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetcore.types import RequestProfile
from fleetcore.fast_replace import replace
from gateway.requests import ParsedRequest


def _same(a: object, b: object) -> None:
    assert type(a) is type(b)
    for f in dataclasses.fields(a):  # type: ignore[arg-type]
        assert getattr(a, f.name) is getattr(b, f.name), f.name


PROFILE = RequestProfile("r1", "m", 64, (1, 2, 3), max_tokens=8, tenant="t", stream=True, arrival=1.5)


@settings(deadline=None)
@given(st.dictionaries(st.sampled_from([f.name for f in dataclasses.fields(RequestProfile)]),
                       st.one_of(st.none(), st.integers(), st.text(max_size=5))))
def test_profile_copies_as_dataclasses_replace(changes: dict[str, object]) -> None:
    got = replace(PROFILE, **changes)
    want = dataclasses.replace(PROFILE, **changes)
    _same(got, want)
    assert got == want and hash(got) == hash(want)
    assert got is not PROFILE
    with pytest.raises(dataclasses.FrozenInstanceError):
        got.model = "x"  # type: ignore[misc]


def test_parsed_request_the_request_paths_copies() -> None:
    parsed = ParsedRequest("chat", {"a": 1}, PROFILE, None, True, requested_model="alias")  # type: ignore[arg-type]
    obs = object()
    for got, want in ((replace(parsed, obs=obs), dataclasses.replace(parsed, obs=obs)),
                      (replace(parsed, profile=replace(PROFILE, request_class="interactive")),
                       dataclasses.replace(parsed, profile=dataclasses.replace(PROFILE, request_class="interactive")))):
        assert got.profile == want.profile
        assert got.obs is want.obs and got.body is parsed.body and got.requested_model == "alias"
        assert got.include_usage is True and got.kind == "chat" and got.key_id is None
    assert replace(parsed, obs=obs).profile is PROFILE
    assert replace(parsed) == parsed and replace(parsed) is not parsed


def test_unknown_field_raises_as_replace() -> None:
    with pytest.raises(TypeError):
        dataclasses.replace(PROFILE, nope=1)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        replace(PROFILE, nope=1)
    with pytest.raises(TypeError):  # and again, once the (class, names) pair is known not to fit
        replace(PROFILE, nope=1)


@dataclass
class _Post:
    x: int
    seen: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.seen.append(self.x)


@dataclass
class _Init:
    x: int
    y: InitVar[int]
    z: int = field(init=False, default=7)


@dataclass
class _Guarded:
    x: int

    def __setattr__(self, name: str, value: object) -> None:
        object.__setattr__(self, name, value * 2 if name == "x" else value)  # type: ignore[operator]


def test_what_init_would_do_differently_goes_to_dataclasses_replace() -> None:
    p = replace(_Post(1), x=2)
    assert p.seen == [1, 2]  # __post_init__ ran, as in dataclasses.replace
    i = _Init(1, 0)
    i.z = 9
    with pytest.raises(ValueError):  # replace demands InitVars
        replace(i, x=2)
    assert replace(i, x=2, y=1).z == 7  # an init=False field is not copied: as replace
    assert replace(_Guarded(1), x=5).x == 10  # the class's own __setattr__ ran


def test_not_a_dataclass() -> None:
    with pytest.raises(TypeError):
        replace(object())
