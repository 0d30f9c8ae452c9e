"""Fleet file validation: every mistake gets a message that names the file and the field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fleetcore.fleet_config import (DEFAULT_FLEET_FILE, FleetConfigError, hash_api_key, load_fleet_file,
                                    parse_fleet)


def base() -> dict[str, Any]:
    return {
        "sites": [{"name": "a", "region": "r1", "jurisdiction": "us", "rtt_ms": {"r1": 1, "r2": 50}},
                  {"name": "b", "region": "r2", "jurisdiction": "eu", "rtt_ms": {"r1": 50, "r2": 1}}],
        "models": [{"name": "m", "versions": ["v1", "v2"], "engine": {"spec": "llama-3.1-8b"}}],
        "deployments": [{"site": "a", "model": "m", "instances": 2}],
        "tenants": [{"name": "t", "api_keys": ["k1"], "region": "r1"}],
    }


def test_default_fleet_is_valid_and_sized_as_documented() -> None:
    c = load_fleet_file(DEFAULT_FLEET_FILE)
    assert len(c.sites) == 3 and len({s.jurisdiction for s in c.sites}) == 2
    assert len(c.models) == 2
    assert sum(d.instance_count for d in c.deployments) == 8


def test_valid_minimal() -> None:
    c = parse_fleet(base())
    assert c.client_regions == ["r1", "r2"]
    assert c.deployment_version(c.deployments[0]) == "v1"
    assert c.tenants[0].key_hashes() == [hash_api_key("k1")]


@pytest.mark.parametrize("mutate, expected", [
    (lambda d: d["deployments"][0].update(site="nowhere"), "deployments[0]: unknown site 'nowhere'"),
    (lambda d: d["deployments"][0].update(model="gpt"), "unknown model 'gpt'"),
    (lambda d: d["deployments"][0].update(version="v9"), "has no version 'v9'"),
    (lambda d: d["deployments"][0].update(instances=-1), "deployments.0.instances"),
    (lambda d: d["deployments"][0].update(adapter="static"), "needs `urls`"),
    (lambda d: d["sites"][0]["rtt_ms"].pop("r2"), "site 'a': rtt_ms lacks client region(s) ['r2']"),
    (lambda d: d["sites"][0]["rtt_ms"].update(r2=-5), "rtt_ms[r2] must be >= 0"),
    (lambda d: d["sites"].append(dict(d["sites"][0])), "sites: duplicate name(s) ['a']"),
    (lambda d: d["tenants"].append({"name": "u", "api_keys": ["k1"]}), "same API key"),
    (lambda d: d["tenants"][0].update(region="mars"), "region 'mars'"),
    (lambda d: d["models"][0]["engine"].update(blocksize=16), "models.0.engine.blocksize: Extra inputs"),
    (lambda d: d.update(sites=[]), "sites: List should have at least 1 item"),
])
def test_invalid_files_name_the_field(mutate: Any, expected: str) -> None:
    data = base()
    mutate(data)
    with pytest.raises(FleetConfigError) as e:
        parse_fleet(data, "fleet.yaml")
    assert str(e.value).startswith("fleet.yaml: invalid fleet file")
    assert expected in str(e.value)


def test_unreadable_and_non_yaml_files(tmp_path: Path) -> None:
    with pytest.raises(FleetConfigError, match="cannot read fleet file"):
        load_fleet_file(tmp_path / "missing.yaml")
    p = tmp_path / "broken.yaml"
    p.write_text("sites: [\n")
    with pytest.raises(FleetConfigError, match="not valid YAML"):
        load_fleet_file(p)
    p.write_text("- just a list\n")
    with pytest.raises(FleetConfigError, match="mapping at top level"):
        load_fleet_file(p)


# --- prefill/decode roles and the interconnect (issue 17) ---


def test_roles_default_to_mixed_and_split_in_instance_order() -> None:
    c = parse_fleet(base())
    assert c.deployments[0].instance_roles() == ["mixed", "mixed"]
    assert c.sites[0].interconnect.bandwidth_gb_s == 50.0 and c.wan.bandwidth_gb_s == 1.25
    d = base()
    d["deployments"][0].update(instances=5, roles={"decode": 3, "prefill": 2})
    d["sites"][0]["interconnect"] = {"bandwidth_gb_s": 25, "latency_ms": 0.5}
    d["wan"] = {"bandwidth_gb_s": 2.5}
    c = parse_fleet(d)
    assert c.deployments[0].instance_roles() == ["prefill", "prefill", "decode", "decode", "decode"]
    assert c.sites[0].interconnect.latency_ms == 0.5 and c.wan.bandwidth_gb_s == 2.5


@pytest.mark.parametrize("roles, needle", [
    ({"prefill": 1, "decode": 2}, "counts add up to 3 but the deployment has 2"),
    ({"prefill": 2}, "need a decode or mixed instance"),
    ({"prefill": 3, "decode": -1}, "counts must be >= 0"),
    ({"both": 2}, "Input should be 'mixed', 'prefill' or 'decode'"),
])
def test_bad_roles_are_clear_errors(roles: dict[str, int], needle: str) -> None:
    d = base()
    d["deployments"][0]["roles"] = roles
    with pytest.raises(FleetConfigError, match="roles|prefill") as e:
        parse_fleet(d)
    assert needle in str(e.value)


def test_prefill_may_hand_its_kv_to_another_deployment_of_the_site() -> None:
    d = base()
    d["deployments"] = [{"site": "a", "model": "m", "instances": 2, "roles": {"prefill": 2}},
                        {"site": "a", "model": "m", "instances": 1, "gpu": "H200", "roles": {"decode": 1}}]
    assert parse_fleet(d).deployments[0].instance_roles() == ["prefill", "prefill"]
    d["deployments"][1]["site"] = "b"  # the decode side elsewhere does not count: KV stays in a site
    with pytest.raises(FleetConfigError, match=r"deployments\[0\]: prefill instances of 'm' at 'a'"):
        parse_fleet(d)


def test_bad_interconnect_is_a_field_error() -> None:
    d = base()
    d["sites"][0]["interconnect"] = {"bandwidth_gb_s": 0}
    with pytest.raises(FleetConfigError, match=r"sites\.0\.interconnect\.bandwidth_gb_s"):
        parse_fleet(d)
