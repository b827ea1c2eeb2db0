"""The energy meters on fixture trees of every layout: readings, wrap-around, integration, loss."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from device_agent.meters import ina2xx, ina3221, pi5_pmic, rapl
from device_agent.meters.modelled import ModelledEnergyMeter

FIXTURES = Path(__file__).parent / "fixtures"
FALLBACK = ModelledEnergyMeter(compute_power_w=8.0, memory_power_w=2.0, threads=2)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def copy_fixture(name: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(FIXTURES / name, tmp_path / name))


def quiet(**kwargs):
    return dict(fallback=FALLBACK, log=lambda message: None, **kwargs)


# ------------------------------------------------------------------ layouts
def test_rapl_reads_package_zones_only():
    meter = rapl.detect(FIXTURES / "rapl", **quiet(start_thread=False))
    assert meter is not None and meter.source == "measured:rapl" and meter.kind == "energy"
    assert [zone.name for zone in meter.zones] == ["intel-rapl:0", "intel-rapl:1"]  # not intel-rapl:0:0
    assert meter.reading_now() == {"energy_j": pytest.approx(3000.0)}  # 1000 J + 2000 J, not + 500 J core


def test_rapl_read_interval_rules_out_two_wraps():
    meter = rapl.detect(FIXTURES / "rapl", **quiet(start_thread=False))
    # 262143.33 J at 500 W wraps in 524 s at the fastest; the sampler reads every 60 s (the cap)
    assert meter.interval_s() == 60.0
    assert meter.interval_s() < 262143.32885 / rapl.MAX_POWER_W / 2


def test_jetpack4_iio_uses_the_input_rail_alone():
    meter = ina3221.detect(FIXTURES / "jetson_jp4", **quiet(start_thread=False))
    assert meter is not None and meter.source == "measured:ina3221"
    assert meter.reading_now() == {"power_w": pytest.approx(5.0)}  # POM_5V_IN, not + GPU + CPU (8 W)
    assert "board input rail POM_5V_IN" in meter.detail and "ina3221x" in meter.detail


def test_jetpack4_iio_without_power_file_uses_volts_times_amps(tmp_path):
    root = copy_fixture("jetson_jp4", tmp_path)
    next(root.rglob("in_power0_input")).unlink()
    meter = ina3221.detect(root, **quiet(start_thread=False))
    assert meter.power_w() == pytest.approx(5.0)  # 5000 mV x 1000 mA


def test_jetpack5_hwmon_uses_the_input_rail_alone():
    meter = ina3221.detect(FIXTURES / "jetson_jp5", **quiet(start_thread=False))
    assert meter is not None and meter.source == "measured:ina3221"
    assert meter.power_w() == pytest.approx(7.0)  # VDD_IN only (7.0 + 2.0 + 1.5 would be 10.5)
    assert "board input rail VDD_IN" in meter.detail and "hwmon" in meter.detail


def test_ina3221_without_input_rail_sums_connected_rails_and_says_so():
    meter = ina3221.detect(FIXTURES / "jetson_agx_orin", **quiet(start_thread=False))
    assert meter.power_w() == pytest.approx(9.5)  # the NC channels (1 W each) left out
    assert meter.detail.startswith("sum of rails VDD_GPU_SOC+VDD_CPU_CV+VIN_SYS_5V0+VDDQ_VDD2_1V8AO")
    assert "no board-input rail" in meter.detail


def test_ina2xx_prefers_power1_input():
    meter = ina2xx.detect(FIXTURES / "ina2xx", **quiet(start_thread=False))
    assert meter is not None and meter.source == "measured:ina2xx"
    assert meter.power_w() == pytest.approx(2.5)  # power1_input (µW), not 12 V x 0.2 A = 2.4 W
    assert "ina219" in meter.detail


def test_ina2xx_volts_times_amps_without_power1_input():
    meter = ina2xx.detect(FIXTURES / "ina2xx" / "vi_only", **quiet(start_thread=False))
    assert meter.power_w() == pytest.approx(3.0)


def test_ina2xx_ignores_other_hwmon_chips():
    assert ina2xx.detect(FIXTURES / "jetson_jp5", **quiet()) is None  # ina3221 and a thermal sensor only


PI5_RAILS = {  # (volts, amps) of the fixture's rails that report both
    "3V7_WL_SW": (3.71559500, 0.0), "3V3_SYS": (3.30261800, 0.05171850), "1V8_SYS": (1.79990800, 0.21467260),
    "DDR_VDD2": (1.11062500, 0.02049600), "DDR_VDDQ": (0.60448710, 0.0), "1V1_SYS": (1.10525600, 0.18541310),
    "0V8_SW": (0.80194770, 0.34941680), "VDD_CORE": (0.88725180, 1.54489000), "3V3_DAC": (3.31335000, 0.00018315),
    "3V3_ADC": (3.31506000, 0.00012210), "0V8_AON": (0.80194770, 0.00390720), "HDMI": (5.16049600, 0.02466420),
}


def test_pi5_pmic_parses_rails_with_both_readings():
    rails = pi5_pmic.parse_pmic_read_adc((FIXTURES / "pi5/pmic_read_adc.txt").read_text())
    assert set(rails) == set(PI5_RAILS)  # EXT5V and BATT have a voltage only
    assert rails["VDD_CORE"] == pytest.approx(1.54489000 * 0.88725180)


def test_pi5_pmic_runs_vcgencmd_found_on_path():
    meter = pi5_pmic.detect(path=str(FIXTURES / "pi5/bin"), **quiet(start_thread=False))
    assert meter is not None and meter.source == "measured:pi5-pmic" and meter.rate_hz == 5.0
    assert meter.power_w() == pytest.approx(sum(v * a for v, a in PI5_RAILS.values()))
    assert pi5_pmic.detect(path=str(FIXTURES / "rapl"), **quiet()) is None  # no vcgencmd there


def test_nothing_detected_on_an_empty_tree(tmp_path):
    for module in (rapl, ina3221, ina2xx):
        assert module.detect(tmp_path, **quiet()) is None


# ------------------------------------------------------------------ RAPL wrap-around
def test_rapl_counter_wrap_around(tmp_path):
    root = copy_fixture("rapl", tmp_path)
    zone0, zone1 = root / "sys/class/powercap/intel-rapl:0", root / "sys/class/powercap/intel-rapl:1"
    top = 262143328850
    (zone0 / "energy_uj").write_text(f"{top - 3_000_000}\n")  # 3 J below the wrap
    meter = rapl.detect(root, **quiet(start_thread=False))
    start = meter.read()
    (zone0 / "energy_uj").write_text("2000000\n")  # wrapped: 3 J + 2 J
    (zone1 / "energy_uj").write_text(f"{2_000_000_000 + 1_500_000}\n")  # + 1.5 J, no wrap
    end = meter.read()
    energy, cpu_s = meter.energy_j(start, end)
    assert energy == pytest.approx(6.5)  # (max - a + b) + 1.5 J
    assert cpu_s == pytest.approx(end.cpu_s - start.cpu_s)
    assert meter.source == "measured:rapl"


def test_rapl_background_reads_keep_each_wrap(tmp_path):
    """Two wraps between the step's reads are counted when the sampler read in between."""
    root = copy_fixture("rapl", tmp_path)
    counter = root / "sys/class/powercap/intel-rapl:0/energy_uj"
    top = 262143328850
    counter.write_text(f"{top - 1_000_000}\n")
    meter = rapl.detect(root, **quiet(start_thread=False))
    start = meter.read()
    counter.write_text(f"{top - 1_000_000}\n")  # one full range later (a wrap), seen by the sampler
    counter.write_text("0\n")
    meter.tick()
    counter.write_text(f"{top - 1_000_000}\n")
    meter.tick()
    counter.write_text("4000000\n")
    energy, _ = meter.energy_j(start, meter.read())
    assert energy == pytest.approx(1.0 + (top - 1_000_000) / 1e6 + 1.0 + 4.0)


# ------------------------------------------------------------------ sampled integration
def test_sampled_integration_trapezoid_with_a_fake_clock(tmp_path):
    root = copy_fixture("ina2xx", tmp_path)
    power = root / "sys/class/hwmon/hwmon0/power1_input"
    clock = FakeClock()
    meter = ina2xx.detect(root, **quiet(start_thread=False, clock=clock))
    start = meter.read()  # first sample: 2.5 W at t=100
    clock.now += 1.0
    power.write_text("4500000\n")
    meter.tick()  # 4.5 W at t=101: trapezoid (2.5 + 4.5) / 2 x 1 s = 3.5 J
    clock.now += 0.5  # read between samples: + 4.5 W x 0.5 s
    energy, _ = meter.energy_j(start, meter.read())
    assert energy == pytest.approx(3.5 + 2.25)


def test_sampled_integration_of_a_constant_power_in_real_time():
    """2.5 W sampled by the background thread at 50 Hz for ~0.4 s: energy = P x t within 2%."""
    meter = ina2xx.detect(FIXTURES / "ina2xx", **quiet())
    try:
        start = meter.read()
        time.sleep(0.4)
        end = meter.read()
        assert meter._thread is not None and meter._thread.is_alive()
        assert end.wall_s - 0.1 < meter._last[0] <= end.wall_s  # the thread took samples during the wait
        energy, _ = meter.energy_j(start, end)
        assert energy == pytest.approx(2.5 * (end.wall_s - start.wall_s), rel=0.02)
    finally:
        meter.close()
    assert meter._thread is None


# ------------------------------------------------------------------ a meter that disappears
def test_power_meter_lost_mid_run_falls_back_and_relabels(tmp_path):
    root = copy_fixture("jetson_jp5", tmp_path)
    logged = []
    clock = FakeClock()
    meter = ina3221.detect(root, fallback=FALLBACK, log=logged.append, clock=clock, start_thread=False)
    start = meter.read()
    clock.now += 2.0
    end = meter.read()
    assert meter.energy_j(start, end)[0] == pytest.approx(14.0) and meter.source == "measured:ina3221"
    (root / "sys/class/hwmon/hwmon1/curr1_input").unlink()  # the meter vanishes
    meter.tick()  # the sampler notices: no exception
    for _ in range(3):
        start, end = end, meter.read()
        energy, cpu_s = meter.energy_j(start, end, paging_s=0.25)
        assert end.energy_j is None
        assert energy == pytest.approx(cpu_s * 8.0 / 2 + 0.25 * 2.0)  # the modelled estimate
        assert meter.source.startswith("modelled:cpu-time×power (ina3221 lost at ")
    assert len(logged) == 1 and "measured:ina3221 lost" in logged[0]


def test_counter_meter_lost_mid_run_falls_back(tmp_path):
    root = copy_fixture("rapl", tmp_path)
    logged = []
    meter = rapl.detect(root, fallback=FALLBACK, log=logged.append, start_thread=False)
    start = meter.read()
    shutil.rmtree(root / "sys/class/powercap/intel-rapl:1")
    end = meter.read()  # the read itself notices
    energy, cpu_s = meter.energy_j(start, end, paging_s=1.0)
    assert energy == pytest.approx(cpu_s * 4.0 + 2.0)
    assert meter.source.startswith("modelled:cpu-time×power (rapl lost at ") and "FileNotFoundError" in meter.source
    meter.read()
    assert len(logged) == 1


def test_background_sampler_notices_a_lost_meter_and_stops(tmp_path):
    root = copy_fixture("ina2xx", tmp_path)
    logged = []
    meter = ina2xx.detect(root, fallback=FALLBACK, log=logged.append)
    meter.read()
    (root / "sys/class/hwmon/hwmon0/power1_input").unlink()
    (root / "sys/class/hwmon/hwmon0/in1_input").unlink()
    deadline = time.monotonic() + 5
    while meter.lost is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert meter.lost is not None and len(logged) == 1
    meter._thread.join(timeout=2)
    assert not meter._thread.is_alive()
    assert meter.read().energy_j is None and meter.source.startswith("modelled:cpu-time×power (ina2xx lost")
    meter.close()


def test_pi5_pmic_lost_when_vcgencmd_fails(tmp_path):
    root = copy_fixture("pi5", tmp_path)
    meter = pi5_pmic.detect(path=str(root / "bin"), **quiet(start_thread=False))
    start = meter.read()
    (root / "pmic_read_adc.txt").write_text("")  # no rails any more
    meter.tick()
    energy, cpu_s = meter.energy_j(start, meter.read())
    assert energy == pytest.approx(cpu_s * 4.0)
    assert meter.source.startswith("modelled:cpu-time×power (pi5-pmic lost at ")
