"""Sizes, hardware presets and profiles."""
from __future__ import annotations

import json

import pytest

from planner.errors import InputError
from planner.hardware import GiB, from_gpu_sizes, load_hardware, parse_size, preset_names


@pytest.mark.parametrize("text,value", [("24GiB", 24 * GiB), ("24G", 24 * GiB), ("24576MiB", 24 * GiB),
                                        ("24000000000", 24_000_000_000), ("24GB", 24_000_000_000),
                                        ("1.5GiB", int(1.5 * GiB)), (" 8 gib ", 8 * GiB)])
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("bad", ["", "24 parsecs", "-1G", "0", "GiB", "24GiBs", "1e9"])
def test_bad_size_is_an_input_error(bad):
    with pytest.raises(InputError, match="bad size"):
        parse_size(bad)


def test_presets_load_and_round_trip_through_json(tmp_path):
    names = preset_names()
    assert {"gpu-box", "rtx3090-ddr4", "rtx4090-ddr5", "rtx5090-ddr5", "server-12ch-ddr5", "desktop-ddr5"} <= set(names)
    for n in names:
        hw = load_hardware(n)
        path = tmp_path / f"{n}.json"
        path.write_text(json.dumps(hw.to_dict()))
        assert load_hardware(str(path)) == hw


def test_gpu_sizes_alone_mean_a_generic_desktop():
    hw = from_gpu_sizes("24GiB,16GiB")
    assert [g.vram_bytes for g in hw.gpus] == [24 * GiB, 16 * GiB]
    assert hw.host.mem_bw == load_hardware("desktop-ddr5").host.mem_bw


def test_unknown_hardware_preset_lists_known():
    with pytest.raises(InputError, match="known: .*gpu-box"):
        load_hardware("my-dream-box")
