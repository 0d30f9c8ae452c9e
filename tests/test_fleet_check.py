"""`tokenfleet check`: every problem at once, with its YAML line and a "did you mean"."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from fleetcore.fleet_check import allowed_fields, check_fleet_text, line_map

SCHEMA_ERRORS = """\
regions: [us-east]
sites:
  - {name: east, region: us-east, jurisdiction: us}
models:
  - name: llama
    engine: {spec: llama-3.1-8b}
    fallbaks: [x]
deployments:
  - {site: east, model: llama, adapter: simm}
  - site: east
    model: llama
    gpuu: H100
"""

CROSS_ERRORS = """\
regions: [us-east]
default_region: us-eats
sites:
  - {name: east, region: us-east, jurisdiction: us}
models:
  - name: llama
    engine: {spec: llama-3.1-8b}
    fallbacks: [lama]
deployments:
  - {site: eats, model: llama}
  - site: east
    model: lamma
aliases: {fast: llama, llama: fast}
"""


def test_schema_errors_all_at_once_with_lines_and_suggestions() -> None:
    config, problems = check_fleet_text(SCHEMA_ERRORS)
    assert config is None
    got = [(p.line, p.where, p.message) for p in problems]
    assert got == [
        (7, "models.0.fallbaks", "unknown field 'fallbaks' (did you mean 'fallbacks'?)"),
        (9, "deployments.0.adapter", "Input should be 'sim', 'static', 'vllm' or 'sglang' (did you mean 'sim'?)"),
        (12, "deployments.1.gpuu", "unknown field 'gpuu' (did you mean 'gpu'?)"),
    ]


def test_cross_field_errors_all_at_once_with_lines() -> None:
    config, problems = check_fleet_text(CROSS_ERRORS)
    assert config is None
    by_line = {p.line: p for p in problems}
    assert "did you mean 'us-east'" in by_line[2].message
    assert "(did you mean 'llama'?)" in by_line[6].message and "fallback 'lama'" in by_line[6].message
    assert by_line[10].where == "deployments.0" and "unknown site 'eats'" in by_line[10].message
    assert "did you mean 'east'" in by_line[10].message
    assert by_line[11].where == "deployments.1" and "did you mean 'llama'" in by_line[11].message
    assert sorted(p.message for p in problems if p.line == 13) == [
        "'llama' shadows the model of the same name", "cycle fast -> llama -> fast"]
    assert len(problems) == 6


def test_yaml_syntax_error_has_its_line() -> None:
    _, problems = check_fleet_text("sites:\n  - {name: a\nmodels: []\n")
    assert len(problems) == 1 and problems[0].line == 3 and "not valid YAML" in problems[0].message


def test_valid_file_has_no_problems_and_helpers() -> None:
    text = "sites: [{name: a, region: r, jurisdiction: j}]\nmodels: [{name: m, engine: {spec: llama-3.1-8b}}]\n"
    config, problems = check_fleet_text(text)
    assert config is not None and problems == []
    assert line_map(text)[("models", 0, "engine", "spec")] == 2
    assert "max_model_len" in allowed_fields(("models", 0, "engine"))
    assert "tokens_per_minute" in allowed_fields(("tenants", 0, "budgets"))


def test_cli_prints_every_problem(tmp_path: Path) -> None:
    bad = tmp_path / "fleet.yaml"
    bad.write_text(CROSS_ERRORS)
    r = subprocess.run([sys.executable, "-m", "tokenfleet", "check", "--fleet", str(bad)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "6 problem(s)" in r.stderr
    assert f"{bad}:10: deployments.0: unknown site 'eats'" in r.stderr


def test_field_errors_and_unknown_names_in_one_pass() -> None:
    text = SCHEMA_ERRORS.replace("model: llama\n    gpuu", "model: lama\n    gpuu")
    _, problems = check_fleet_text(text)
    got = {(p.line, p.where): p.message for p in problems}
    assert got[(12, "deployments.1.gpuu")] == "unknown field 'gpuu' (did you mean 'gpu'?)"
    assert got[(11, "deployments.1.model")].endswith("(did you mean 'llama'?)")


ADAPTER_ERRORS = """\
sites:
  - {name: s1, region: r, jurisdiction: j}
models:
  - name: m
    engine: {spec: llama-3.1-8b}
deployments:
  - {site: s1, model: m, instances: 1, gpu: H100, options: {network_rtt: 5}}
  - {site: s1, model: m, instances: 1, gpu: H100, options: {time_scael: 2}}
"""


def test_adapter_options_are_problems_too_not_a_traceback(tmp_path: Path) -> None:
    """Unknown sim options live in the adapter; `check` reports each deployment's, with lines."""
    f = tmp_path / "fleet.yaml"
    f.write_text(ADAPTER_ERRORS)
    done = subprocess.run([sys.executable, "-m", "tokenfleet", "check", "--fleet", str(f)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    lines = [ln.strip() for ln in done.stderr.splitlines()[1:]]
    assert lines == [
        f"{f}:7: deployments.0.options: s1/m: unknown sim option(s) 'network_rtt' (did you mean 'network_rtt_ms'?) "
        "(known: time_scale, num_gpu_blocks_override, startup_s, network_rtt_ms, urls, pd_protocol)",
        f"{f}:8: deployments.1.options: s1/m#1: unknown sim option(s) 'time_scael' (did you mean 'time_scale'?) "
        "(known: time_scale, num_gpu_blocks_override, startup_s, network_rtt_ms, urls, pd_protocol)",
    ]


def test_role_errors_are_located_at_their_deployment() -> None:
    text = """\
sites:
  - {name: east, region: us-east, jurisdiction: us}
models:
  - name: llama
    engine: {spec: llama-3.1-8b}
deployments:
  - {site: east, model: llama, instances: 2, roles: {prefill: 2}}
"""
    config, problems = check_fleet_text(text)
    assert config is None
    assert [(p.line, p.where) for p in problems] == [(7, "deployments.0")]
    assert "need a decode or mixed instance" in problems[0].message
    config, problems = check_fleet_text(text.replace("{prefill: 2}", "{prefill: 1, decode: 2}"))
    assert config is None and problems[0].line == 7 and "add up to 3" in problems[0].message
