"""Platform profiles: shipped files, schema round trip, and validation errors naming file, field and unit."""

from __future__ import annotations

import copy
import json
import math
import os
from dataclasses import replace

import pytest

from host.costs.profile import (
    PlatformProfile,
    ProfileError,
    UnknownPlatformError,
    known_field_paths,
    list_platforms,
    load_profile,
    save_profile,
)

SHIPPED = ["a72", "a72nocache", "jetsontx2", "m0", "m4"]

# POET chipsets.py (ShishirPatil/poet), evaluated exactly as published.
PAPER = {
    "m0": dict(
        FLOPS_PER_WATT=2000 / (0.012 * 0.020 * 3.3),
        FLOPS=2000 / 0.012,
        PAGEIN_LATENCY=0.109 * (10 ** (-3)),
        PAGEIN_THROUGHPUT=4616.51 * (10 ** (3)),
        PAGEOUT_LATENCY=0.113 * (10 ** (-3)),
        PAGEOUT_THROUGHPUT=4440 * (10 ** (3)),
        MEMORY_POWER=100 * (10 ** (-3)) * 3.3,
        POWER=20 * (10 ** (-3)) * 3.3,
    ),
    "m4": dict(
        FLOPS_PER_WATT=(16283 * 100 * 1000) / (255.6237 * 0.003328 * 3.3),
        FLOPS=(16283 * 100 * 1000) / (255.6237),
        PAGEIN_LATENCY=0.109 * (10 ** (-3)),
        PAGEIN_THROUGHPUT=4616.51 * (10 ** (3)),
        PAGEOUT_LATENCY=0.113 * (10 ** (-3)),
        PAGEOUT_THROUGHPUT=4440 * (10 ** (3)),
        MEMORY_POWER=100 * (10 ** (-3)) * 3.3,
        POWER=3.328 * (10 ** (-3)) * 3.3,
    ),
    "a72": dict(
        FLOPS_PER_WATT=(16283 * 100 * 1000) / (13.53 * 0.6 * 5),
        FLOPS=(2 * 1000 * 1000 * 1000),
        PAGEIN_LATENCY=0.00509561 * (10 ** (-3)),
        PAGEIN_THROUGHPUT=45.5 * (10 ** (6)),
        PAGEOUT_LATENCY=0.0185314 * (10 ** (-3)),
        PAGEOUT_THROUGHPUT=24.5 * (10 ** (6)),
        MEMORY_POWER=30 * (10 ** (-3)) * 5,
        POWER=0.6 * 5,
    ),
    "a72nocache": dict(
        FLOPS_PER_WATT=(16283 * 100 * 1000) / (13.53 * 0.6 * 5),
        FLOPS=(16283 * 100 * 1000) / (13.53),
        PAGEIN_LATENCY=0.00509561 * (10 ** (-3)),
        PAGEIN_THROUGHPUT=45.5 * (10 ** (6)),
        PAGEOUT_LATENCY=4.23532 * (10 ** (-3)),
        PAGEOUT_THROUGHPUT=17.1 * (10 ** (6)),
        MEMORY_POWER=30 * (10 ** (-3)) * 5,
        POWER=0.6 * 5,
    ),
    "jetsontx2": dict(  # the paper gives no FLOPS / FLOPS_PER_WATT for the TX2
        PAGEIN_LATENCY=0.00054,
        PAGEOUT_LATENCY=0.002396,
        POWER=(995 - 229) * (10 ** (-3)),
        PAGEIN_THROUGHPUT=108.5 * (10 ** (6)),
        PAGEOUT_THROUGHPUT=94.37 * (10 ** (6)),
        MEMORY_POWER=309 * (10 ** (-3)),
    ),
}


def _write(tmp_path, data, name="bad.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(data) if not isinstance(data, str) else data, encoding="utf-8")
    return str(path)


def _valid_dict() -> dict:
    return load_profile("a72").to_dict()


# --------------------------------------------------------------------------- shipped profiles
def test_list_platforms_is_sorted_and_complete():
    assert list_platforms() == SHIPPED


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_profile_loads_and_documents_every_constant(name):
    profile = load_profile(name)
    assert profile.name == name
    assert profile.path is not None and profile.path.endswith(f"{name}.json")
    assert profile.energy_source.startswith("modelled:poet2022-constants")
    assert profile.bytes_per_element == 4
    assert profile.energy_per_flop_j is not None
    for field_path in (
        "compute.flops_per_s.default",
        "compute.energy_per_flop_j",
        "compute.compute_power_w",
        "page_in.latency_s",
        "page_in.throughput_bytes_per_s",
        "page_out.latency_s",
        "page_out.throughput_bytes_per_s",
        "memory_power_w",
        "board_power_w",
        "bytes_per_element",
    ):
        assert profile.sources.get(field_path), f"{name}: no source for {field_path}"


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_constants_are_the_papers_exactly(name):
    paper = PAPER[name]
    profile = load_profile(name)
    assert profile.page_in_latency_s == paper["PAGEIN_LATENCY"]
    assert profile.page_in_throughput_bytes_per_s == paper["PAGEIN_THROUGHPUT"]
    assert profile.page_out_latency_s == paper["PAGEOUT_LATENCY"]
    assert profile.page_out_throughput_bytes_per_s == paper["PAGEOUT_THROUGHPUT"]
    assert profile.memory_power_w == paper["MEMORY_POWER"]
    assert profile.compute_power_w == paper["POWER"]
    if "FLOPS" in paper:
        assert profile.flops_per_s == {"default": paper["FLOPS"]}
        assert 1.0 / profile.energy_per_flop_j == paper["FLOPS_PER_WATT"]  # bit-exact flop-per-joule


def test_jetsontx2_compute_is_a_documented_poet_edge_estimate():
    profile = load_profile("jetsontx2")
    assert profile.flops_per_s == {"default": 2.0e9}
    assert math.isclose(profile.energy_per_flop_j, PAPER["jetsontx2"]["POWER"] / 2.0e9, rel_tol=1e-15)
    assert "not from POET" in profile.sources["compute.flops_per_s.default"]
    assert "not from POET" in profile.sources["compute.energy_per_flop_j"]
    assert "NOT the paper's" in profile.description


# --------------------------------------------------------------------------- round trip and saving
@pytest.mark.parametrize("name", SHIPPED)
def test_schema_round_trip(name, tmp_path):
    profile = load_profile(name)
    again = PlatformProfile.from_dict(json.loads(json.dumps(profile.to_dict())))
    assert replace(again, path=profile.path) == profile
    target = tmp_path / f"{name}-copy.json"
    save_profile(profile, target)
    loaded = load_profile(str(target))
    assert loaded.path == str(target)
    assert replace(loaded, path=profile.path) == profile


def test_profile_without_energy_per_flop_round_trips(tmp_path):
    data = _valid_dict()
    del data["compute"]["energy_per_flop_j"]
    data["compute"]["flops_per_s"]["matmul"] = 5.0e9
    profile = PlatformProfile.from_dict(data)
    assert profile.energy_per_flop_j is None
    assert profile.flops_per_s_for("matmul") == 5.0e9
    assert profile.flops_per_s_for("pool") == profile.flops_per_s["default"]
    save_profile(profile, tmp_path / "p.json")
    assert replace(load_profile(str(tmp_path / "p.json")), path=None) == profile
    data["compute"]["energy_per_flop_j"] = None  # explicit null is accepted too
    assert PlatformProfile.from_dict(data).energy_per_flop_j is None


def test_save_is_atomic_and_leaves_no_temporary_files(tmp_path):
    target = tmp_path / "out.json"
    target.write_text("old", encoding="utf-8")
    save_profile(load_profile("m4"), target)
    assert os.listdir(tmp_path) == ["out.json"]
    assert json.loads(target.read_text(encoding="utf-8"))["name"] == "m4"


def test_save_refuses_an_invalid_profile_and_keeps_the_old_file(tmp_path):
    target = tmp_path / "out.json"
    target.write_text("old", encoding="utf-8")
    bad = replace(load_profile("m4"), page_in_throughput_bytes_per_s=0.0)
    with pytest.raises(ProfileError, match="page_in.throughput_bytes_per_s"):
        save_profile(bad, target)
    assert target.read_text(encoding="utf-8") == "old"
    assert os.listdir(tmp_path) == ["out.json"]


def test_save_into_missing_directory_names_it(tmp_path):
    with pytest.raises(ProfileError, match="does not exist"):
        save_profile(load_profile("m4"), tmp_path / "nope" / "p.json")


# --------------------------------------------------------------------------- errors
def test_unknown_platform_lists_valid_names():
    with pytest.raises(UnknownPlatformError) as info:
        load_profile("a73")
    message = str(info.value)
    assert "'a73'" in message
    for name in SHIPPED:
        assert name in message
    assert isinstance(info.value, ProfileError) and isinstance(info.value, ValueError)


def test_missing_profile_file_names_it(tmp_path):
    missing = str(tmp_path / "nope.json")
    with pytest.raises(ProfileError, match="nope.json: profile file not found"):
        load_profile(missing)


def _mutated(mutate) -> dict:
    data = copy.deepcopy(_valid_dict())
    mutate(data)
    return data


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (
            lambda d: d["page_in"].pop("latency_s"),
            "bad.json: missing required field 'page_in.latency_s': expected a non-negative number in seconds",
        ),
        (
            lambda d: d["compute"]["flops_per_s"].pop("default"),
            "missing required field 'compute.flops_per_s.default': expected a positive number in FLOP per second",
        ),
        (
            lambda d: d.pop("memory_power_w"),
            "missing required field 'memory_power_w': expected a non-negative number in watts",
        ),
        (
            lambda d: d["page_in"].__setitem__("latency_s", "fast"),
            "bad.json: field 'page_in.latency_s' must be a non-negative number in seconds, got 'fast'",
        ),
        (
            lambda d: d["page_out"].__setitem__("latency_s", -1e-3),
            "field 'page_out.latency_s' must be a non-negative number in seconds, got -0.001",
        ),
        (
            lambda d: d["page_in"].__setitem__("compute_thread_s", float("nan")),
            "field 'page_in.compute_thread_s' must be a non-negative number in seconds, got nan",
        ),
        (
            lambda d: d["page_out"].__setitem__("compute_thread_s", -1e-4),
            "field 'page_out.compute_thread_s' must be a non-negative number in seconds, got -0.0001",
        ),
        (
            lambda d: d["page_out"].__setitem__("throughput_bytes_per_s", 0),
            "field 'page_out.throughput_bytes_per_s' must be a positive number in bytes per second, got 0",
        ),
        (
            lambda d: d["compute"]["flops_per_s"].__setitem__("default", True),
            "field 'compute.flops_per_s.default' must be a positive number in FLOP per second, got True",
        ),
        (
            lambda d: d["compute"].__setitem__("energy_per_flop_j", -2.0),
            "field 'compute.energy_per_flop_j' must be a positive number in joules per FLOP",
        ),
        (
            lambda d: d["compute"].__setitem__("compute_power_w", float("nan")),
            "field 'compute.compute_power_w' must be a positive number in watts, got nan",
        ),
        (
            lambda d: d.__setitem__("memory_power_w", float("inf")),
            "field 'memory_power_w' must be a non-negative number in watts, got inf",
        ),
        (
            lambda d: d.__setitem__("bytes_per_element", 4.5),
            "field 'bytes_per_element' must be a positive integer in bytes, got 4.5",
        ),
        (lambda d: d.__setitem__("schema_version", 2), "field 'schema_version' must be the integer 1, got 2"),
        (lambda d: d.__setitem__("name", ""), "field 'name' must be a non-empty string"),
        (lambda d: d.__setitem__("energy_source", "guessed"), "field 'energy_source' must start with 'modelled:'"),
        (lambda d: d.__setitem__("page_in", [1, 2]), "field 'page_in' must be a JSON object, got list"),
        (lambda d: d.__setitem__("power_w", 3.0), "bad.json: unknown field(s) 'power_w'"),
        (lambda d: d["page_in"].__setitem__("latency_ms", 3.0), "unknown field(s) 'page_in.latency_ms'"),
        (
            lambda d: d["compute"]["flops_per_s"].__setitem__("attention", 1e9),
            "unknown field(s) 'compute.flops_per_s.attention'; allowed in field 'compute.flops_per_s': default, input",
        ),
        (
            lambda d: d["compute"].__setitem__("class_node_overhead_s", {"fwd": {"conv": -1e-4}}),
            "field 'compute.class_node_overhead_s.fwd.conv' must be a non-negative number in seconds, got -0.0001",
        ),
        (
            lambda d: d["compute"].__setitem__("class_node_overhead_s", {"fwd": {"attention": 1e-4}}),
            "unknown field(s) 'compute.class_node_overhead_s.fwd.attention'",
        ),
        (
            lambda d: d.__setitem__("step", {"transfer_overlap": 1.5}),
            "field 'step.transfer_overlap' must be a share from 0 to 1 (the part of a page transfer's time hidden "
            "behind compute), got 1.5",
        ),
        (
            lambda d: d.__setitem__("step", {"transfer_overlap": float("nan")}),
            "field 'step.transfer_overlap' must be a share from 0 to 1",
        ),
        (
            lambda d: d.__setitem__("step", {"transfer_overlap": "half"}),
            "field 'step.transfer_overlap' must be a share from 0 to 1",
        ),
        (
            lambda d: d["sources"].__setitem__("page_in.latency_ms", "x"),
            "'sources' has an entry for unknown field 'page_in.latency_ms'",
        ),
    ],
)
def test_malformed_profile_errors_name_file_field_and_unit(tmp_path, mutate, expected):
    path = _write(tmp_path, _mutated(mutate))
    with pytest.raises(ProfileError) as info:
        load_profile(path)
    message = str(info.value)
    assert message.startswith(path + ": ")
    assert expected in message


def test_broken_json_names_file_line_and_column(tmp_path):
    path = _write(tmp_path, '{\n  "schema_version": 1,\n  "name": "x"\n  "description": ""\n}\n')
    with pytest.raises(ProfileError, match=r"bad\.json: invalid JSON at line 4, column 3"):
        load_profile(path)


def test_non_object_top_level(tmp_path):
    with pytest.raises(ProfileError, match="bad.json: the top level must be a JSON object, got list"):
        load_profile(_write(tmp_path, [1, 2]))


def test_user_profile_name_comes_from_its_content(tmp_path):
    data = _valid_dict()
    data["name"] = "my-board"
    profile = load_profile(_write(tmp_path, data, "whatever.json"))
    assert profile.name == "my-board"


def test_known_field_paths_cover_every_key_of_to_dict():
    known = set(known_field_paths())
    data = _valid_dict()
    for block in ("page_in", "page_out"):
        for key in data[block]:
            assert f"{block}.{key}" in known
    for key in data["compute"]:
        assert f"compute.{key}" in known


def test_a_transfer_overlap_share_round_trips_and_prices_a_paging_step_longer():
    """step.transfer_overlap (absent: 1) reaches the priced graph, whose overlapped step grows as less is hidden."""
    from host.costs.pricing import price_graph
    from tests.host.calibrate.test_fit_profile import _graph, _schedules

    data = _valid_dict()
    data["step"] = {"transfer_overlap": 0.25}
    profile = PlatformProfile.from_dict(data)
    assert profile.transfer_overlap == 0.25 and profile.to_dict()["step"]["transfer_overlap"] == 0.25
    assert PlatformProfile.from_dict(_valid_dict()).transfer_overlap == 1.0
    assert "transfer_overlap" not in PlatformProfile.from_dict(_valid_dict()).to_dict().get("step", {})
    graph = _graph()
    paging = _schedules(graph)[2]
    from device_agent.replay import replay

    in_use = replay(graph.nodes, paging.instructions, graph_label=graph.name).ram_timeline_bytes
    hidden = price_graph(graph, replace(profile, transfer_overlap=1.0)).overlapped_runtime_s(paging.instructions, in_use, 0)
    shared = price_graph(graph, profile).overlapped_runtime_s(paging.instructions, in_use, 0)
    serial = price_graph(graph, replace(profile, transfer_overlap=0.0)).overlapped_runtime_s(paging.instructions, in_use, 0)
    assert hidden < shared < serial
