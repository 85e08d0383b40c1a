"""`fusionai sim calibrate`: the software's costs per hop measured through the real p2p stack
and this machine's profile, saved and read back; the cost model charging them per hop end;
and the simulator using them for swarm hops but not for a GPU interconnect's."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from cli.main import main
from cli.sim_calibrate import calibrate
from dag.cost import HardwareProfile, Workload, pipeline_metrics
from dag.model import LLAMA2_7B
from sim.calibration import VERSION, Calibration, load, save
from sim.cgroup import cpu_s

pytestmark = pytest.mark.timeout(120)


def test_calibrate_measures_the_stack_and_the_machine(tmp_path: Path) -> None:
    out = calibrate(count=40, mib=1)
    assert isinstance(out, Calibration)
    assert 0 < out.small_rtt_s < out.large_rtt_s  # a MiB costs more than 64 floats
    assert out.call_s == pytest.approx(out.small_rtt_s / 4)
    assert 1e-11 < out.wire_s_per_byte < 1e-6  # between 1 TB/s and 1 MB/s an end
    assert 1e-6 < out.stage_call_s < 0.05
    assert out.profile.flops["float32"] > 1e8 and out.profile.mem_bandwidth > 1e8
    # a killed peer's request fails where it is made (a dial again would wait 0.7 s); a new
    # connection's set-up takes at least its protocols' round trips (TCP, multistream twice,
    # Noise's one and a half); a protocol's first request on it waits for its negotiation
    assert out.dead_dial_s is not None and 0 <= out.dead_dial_s < 0.1
    assert out.connect_rtts is not None and 4 < out.connect_rtts < 9
    assert 0 <= out.connect_base_s < 0.1
    assert 1 < out.protocol_rtts < 4 and 0 <= out.protocol_s < 0.1
    save(out, tmp_path / "c.json")
    assert load(tmp_path / "c.json") == out
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**json.loads((tmp_path / "c.json").read_text()), "call_s": -1}))
    with pytest.raises(ValueError, match="not a calibration file"):
        load(bad)
    old = {**json.loads((tmp_path / "c.json").read_text()), "version": 3, "gone": 1}
    bad.write_text(json.dumps(old))  # (an older version's fields, here unknown)
    with pytest.raises(ValueError, match="version 3; this reads 4: run `fusionai sim calibrate"):
        load(bad)


def test_every_hop_end_pays_the_software_costs() -> None:
    bare = HardwareProfile("m", {"float16": 30e12}, 10e9, 700e9, 5e6, 0.04)
    c, w = 0.5e-3, 4e-9
    run = 2e-3
    timed = dataclasses.replace(bare, call_s=c, wire_s_per_byte=w, stage_call_s=run)
    work = Workload(tokens=1, sequences=1, context=512)
    hidden = LLAMA2_7B.hidden_bytes_per_token
    end = c + hidden * w
    for star, legs in ((False, 4 + 1), (True, 2 * 4)):
        before = pipeline_metrics(LLAMA2_7B, [(bare, 8)] * 4, work, star=star)
        after = pipeline_metrics(LLAMA2_7B, [(timed, 8)] * 4, work, star=star)
        # two ends a leg, and an executor call a stage
        assert after.latency - before.latency == pytest.approx(2 * end * legs + 4 * run)
        assert after.bottleneck - before.bottleneck == pytest.approx(2 * end + run)  # in, out


def test_the_simulator_charges_swarm_hops_not_nvlink(tmp_path: Path) -> None:
    fixed = Calibration(
        version=VERSION, machine="test", measured_at=0.0, call_s=1e-3, frame_bytes=75.0,
        connect_s=0.25, wire_s_per_byte=5e-9, stage_call_s=5e-4,
        small_rtt_s=4e-3, large_rtt_s=0.1, large_bytes=1 << 20, samples=40,
        profile=load_profile(),
    )  # fmt: skip
    save(fixed, tmp_path / "c.json")
    scenario = tmp_path / "s.toml"
    scenario.write_text(
        '[defaults]\nhours = 0.25\nworkload = "llama2-7b-inference"\n'
        '[[run]]\nname = "swarm"\npeers = 20\nnetwork = "home-fiber"\n'
        '[[run]]\nname = "dc"\npeers = 4\ngpus = { h100-sxm = 1 }\nnetwork = "nvlink4"\n'
    )
    results = {}
    calibrated = ["--calibration", str(tmp_path / "c.json")]
    for label, extra in (("bare", []), ("calibrated", calibrated)):
        out = ["--out", str(tmp_path / label)]
        assert main(["sim", "--scenario", str(scenario), *out, *extra]) == 0
        doc = json.loads((tmp_path / label / "result.json").read_text())
        results[label] = {n: r["throughput_tokens_s"] for n, r in doc["runs"].items()}
    assert results["calibrated"]["swarm"] < results["bare"]["swarm"]  # software costs time
    assert results["calibrated"]["dc"] == results["bare"]["dc"]  # not on NVLink
    missing = ["sim", "--scenario", str(scenario), "--calibration", str(tmp_path / "none.json")]
    assert main(missing) == 2


def load_profile() -> object:
    from sim.calibration import MeasuredProfile

    return MeasuredProfile("cpu", "ort", {"float32": 3e11}, 1.5e10, 2.5e10)


def test_a_process_s_cpu_time_is_read_to_well_under_a_clock_tick() -> None:
    """The calibration reads providers' CPU per token as differences of `cpu_s` over a few
    dozen tokens: a child that has used a known CPU time, just over 6 ms past a whole tick,
    reads within 2 ms of it (the ticks `/proc/PID/stat` keeps would read it 6 ms short), and
    a gone process reads None."""
    schedstat = Path("/proc/self/schedstat")
    if not schedstat.exists() or schedstat.read_text().startswith("0 "):
        pytest.skip("this kernel keeps no schedstat: the CPU time is read in clock ticks")
    spin = (
        "import sys, time\n"
        "while not (time.process_time() > 0.15 and 0.0062 < time.process_time() % 0.01 < 0.0068):\n"
        "    pass\n"
        "print(time.process_time(), flush=True)\n"
        "sys.stdin.read()\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", spin], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None
        used = float(child.stdout.readline())
        read = cpu_s(child.pid)
        assert read is not None and abs(read - used) < 0.002, (read, used)
    finally:
        child.kill()
        child.wait()
    assert cpu_s(child.pid) is None
