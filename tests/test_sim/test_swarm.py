"""The simulator: deterministic, conserving, matching closed forms, driving the real re-plan."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from sim.catalog import CHURN, GPUS, NETWORKS
from sim.scenario import Scenario, load_study, scenario_from, shipped
from sim.swarm import simulate

CHURNY = Scenario(
    peers=40,
    gpus={"rtx3060": 1, "rtx3080": 1, "rtx3090": 1, "rtx4090": 1},
    workload="llama2-7b-inference",
    churn=CHURN["volunteer"],
    hours=1.0,
    seed=5,
)


def test_same_seed_same_result_and_other_seeds_other_churn() -> None:
    a, b = simulate(CHURNY), simulate(CHURNY)
    assert a.summary() == b.summary()
    assert a.log == b.log and a.timeline == b.timeline
    c = simulate(Scenario(**{**CHURNY.__dict__, "seed": 6}))
    quits_a = [(e["t"], e["peer"]) for e in a.log if e["event"] == "replan"]
    quits_c = [(e["t"], e["peer"]) for e in c.log if e["event"] == "replan"]
    assert quits_a != quits_c


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_no_work_is_lost_or_counted_twice_across_joins_and_quits(seed: int) -> None:
    result = simulate(Scenario(**{**CHURNY.__dict__, "seed": seed}))
    assert result.quits > 10 and result.joins > 5  # churn really happened
    accounted = result.tokens_completed + result.tokens_lost + result.tokens_in_progress
    assert accounted == pytest.approx(result.tokens_processed, rel=1e-9)
    job_tokens = 16 * 256  # a job: 16 sequences x 256 decode steps
    assert result.tokens_completed == pytest.approx(result.jobs_completed * job_tokens)
    assert result.tokens_lost > 0  # quits interrupted jobs, and that work is accounted as lost


def test_throughput_without_churn_matches_a_closed_form_from_the_catalog() -> None:
    # 4 x H100 SXM, Llama-2 7B prefilling then decoding 16 sequences at 1024 tokens of
    # context: each GPU holds the whole model (one replica each); decoding is memory-bound.
    # Computed here from the published shapes and the catalog's figures, not from the cost
    # model's code.
    h100 = GPUS["h100-sxm"]
    hidden, layers, inter, seqs, context = 4096, 32, 11008, 16, 1024
    params = 4 * hidden * hidden + 3 * hidden * inter  # per block: q, k, v, o + gated MLP
    weight_bytes = 2 * params
    kv_read = seqs * context * 2 * hidden * 2  # K and V of every sequence, fp16
    flops = seqs * (2 * params + 4 * hidden * context)
    per_block = max(flops / h100.fp16_tensor, (weight_bytes + kv_read) / h100.mem_bandwidth)
    send = seqs * hidden * 2 / NETWORKS["nvlink4"].up_median
    decode_rate = seqs / (layers * per_block + send)  # tokens/s of one GPU
    # Each job first prefills 16 prompts of 1024 tokens in one pass: compute-bound, causal
    # attention over half the prompt on average; its hidden states go out over NVLink.
    prompt = 1024
    prefill_flops = seqs * prompt * (2 * params + 4 * hidden * prompt / 2)
    prefill_bytes = weight_bytes + seqs * prompt / 2 * 2 * hidden * 2
    prefill_block = max(prefill_flops / h100.fp16_tensor, prefill_bytes / h100.mem_bandwidth)
    prefill_send = seqs * prompt * hidden * 2 / NETWORKS["nvlink4"].up_median
    prefill = layers * prefill_block + prefill_send  # the GPU's busy time for one prefill
    job_tokens = seqs * 256
    expected = 4 * job_tokens / (prefill + job_tokens / decode_rate)
    result = simulate(Scenario(peers=4, gpus={"h100-sxm": 1}, network="nvlink4", hours=1.0))
    steady = [rate for t, rate, _, _ in result.timeline if t > result.startup_s]
    assert max(steady) == pytest.approx(expected, rel=0.05)
    assert min(steady) == pytest.approx(expected, rel=0.05)


def test_a_provider_quit_runs_the_real_replan() -> None:
    result = simulate(CHURNY)
    replans = [e for e in result.log if e["event"] == "replan" and e["moves"]]
    assert replans, "no quit hit a serving provider"
    entry = replans[0]
    # Moves come from the broker's core (broker.core.replan.on_leave): the departed provider's
    # blocks, and only them.
    assert all(source == entry["peer"] for _, _, source, _ in entry["moves"])
    # And the pool state machine saw the loss (broker.core.pool).
    assert "ProviderLost" in entry["pool_actions"]


def test_more_churn_loses_more_time() -> None:
    calm = simulate(Scenario(**{**CHURNY.__dict__, "churn": CHURN["gaming-evening"]}))
    wild = simulate(CHURNY)
    assert wild.summary()["time_lost_to_churn"] > calm.summary()["time_lost_to_churn"]


def test_bad_scenarios_are_refused_clearly(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown GPUs"):
        Scenario(gpus={"gtx480": 1})
    with pytest.raises(ValueError, match="unknown workload"):
        Scenario(workload="gpt5-inference")
    with pytest.raises(ValueError, match="unknown scenario keys"):
        scenario_from({"peerz": 3})
    bad = tmp_path / "bad.toml"
    bad.write_text("[[run]]\nname = 'x'\npeers = 'many'\n")
    with pytest.raises(ValueError, match="run 1"):
        load_study(bad)


def test_shipped_scenarios_load() -> None:
    assert "paper-claim" in shipped()
    for name in shipped():
        study = load_study(name)
        assert study.runs


@pytest.mark.timeout(300)
def test_cli_writes_json_report_and_plot(tmp_path: Path) -> None:
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "cli.main",
            "sim",
            "--peers",
            "20",
            "--gpu",
            "rtx3090",
            "--workload",
            "llama2-7b-finetune",
            "--hours",
            "0.5",
            "--churn",
            "60",
            "--out",
            str(tmp_path),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert run.returncode == 0, run.stderr
    doc = json.loads(run.stdout)
    summary = next(iter(doc["runs"].values()))
    assert summary["peers"] == 20 and summary["workload"] == "llama2-7b-finetune"
    assert summary["throughput_tokens_s"] > 0 and not math.isnan(summary["utilization"])
    assert (tmp_path / "report.txt").read_text().startswith("# ")
    assert (tmp_path / "timeline.png").read_bytes()[:4] == b"\x89PNG"
    assert "100%" in run.stderr  # the progress bar reached the end


@pytest.mark.parametrize("seed", [0, 2, 7])
def test_churn_never_leaves_an_online_provider_dead_or_a_job_time_negative(seed: int) -> None:
    from broker.core.pool import Status
    from sim.swarm import SwarmSim

    sim = SwarmSim(Scenario(**{**CHURNY.__dict__, "peers": 12, "seed": seed, "hours": 2.0}))
    result = sim.run()
    assert result.quits > 5
    for peer in sim.online:  # crashed and back before the crash was noticed: repaired, not dead
        assert sim.pool.providers[peer].status is not Status.DEAD
    assert all(math.isfinite(s) and s >= 0 for s in result.job_seconds)
    json.dumps(result.summary(), allow_nan=False)


def test_a_run_with_nothing_done_still_reports_valid_json() -> None:
    result = simulate(Scenario(peers=1, hours=0.2))  # one 10 GB card cannot hold 7B
    summary = result.summary()
    assert summary["throughput_tokens_s"] == 0 and summary["cost_per_mtok_usd"] is None
    json.dumps(summary, allow_nan=False)


def test_newcomers_arrive_and_some_providers_leave_for_good() -> None:
    result = simulate(CHURNY)
    assert result.arrivals > 0 and result.departures > 0
    joined = [e for e in result.log if e["event"] == "join"]
    newcomers = [e for e in joined if int(e["peer"].rsplit("-", 1)[1]) >= CHURNY.peers]
    assert newcomers, "no newcomer joined during the run"
    departed = {e["peer"]: e["t"] for e in result.log if e["event"] == "departed"}
    assert departed
    for e in joined:  # a provider that left for good never comes back
        assert e["peer"] not in departed or e["t"] < departed[e["peer"]]


def test_inference_jobs_pay_for_their_prefill() -> None:
    result = simulate(Scenario(peers=4, gpus={"h100-sxm": 1}, network="nvlink4", hours=0.2))
    summary = result.summary()
    # The first token waits for the whole prompt's pass: far longer than one decode step.
    assert summary["ttft_ms_p50"] > 5 * summary["token_latency_ms_p50"]
    assert summary["ttft_ms_p50"] < 1e3 * summary["job_seconds_p50"]


def test_petals_style_swarm_stalls_on_an_unserved_block_until_a_server_moves() -> None:
    # Five 12 GB cards barely cover Llama-2 7B's 32 blocks: a quit can leave a block with no
    # server, which stops the whole swarm until a balance check moves a server onto it.
    scenario = Scenario(
        peers=5,
        gpus={"rtx3060": 1},
        placement="petals",
        churn=CHURN["volunteer"],
        seed=2,
        hours=2.0,
    )
    result = simulate(scenario)
    accounted = result.tokens_completed + result.tokens_lost + result.tokens_in_progress
    assert accounted == pytest.approx(result.tokens_processed, rel=1e-9)
    summary = result.summary()
    assert summary["time_lost_to_churn"] > 0
    moves = [e for e in result.log if e["event"] == "rebalance"]
    assert moves and all(0 <= e["span"][0] < e["span"][1] <= 32 for e in moves)
    assert summary["throughput_tokens_s"] > 0
    with pytest.raises(ValueError, match="inference workloads only"):
        Scenario(placement="petals", workload="llama2-7b-finetune")


def test_quantized_weights_and_an_int8_wire_shrink_what_a_block_holds_and_sends() -> None:
    from sim.report import assumptions
    from sim.workloads import quantized, workload

    base = workload("llama2-7b-inference")
    int4 = quantized(base, "int4", "int8")
    assert int4.model.layer_param_bytes == pytest.approx(base.model.layer_param_bytes * 0.3125)
    # half the bytes per hidden value, plus one float32 scale per token
    assert int4.model.hidden_bytes_per_token == base.model.hidden_bytes_per_token / 2 + 4
    assert int4.model.layer_flops_per_token == base.model.layer_flops_per_token
    with pytest.raises(ValueError, match="inference workloads only"):
        quantized(workload("llama2-7b-finetune"), "int4")
    with pytest.raises(ValueError, match="weights must be one of"):
        Scenario(weights="int3")
    run = Scenario(peers=8, hours=0.2, seed=3, weights="int4", wire="int8")
    stated = assumptions(run)["workload"]
    assert (stated["weights"], stated["wire"], stated["bytes_per_weight"]) == (
        "int4",
        "int8",
        0.625,
    )
    assert simulate(run).summary()["tokens_completed"] > 0


def test_chained_steps_and_batches_are_modelled() -> None:
    """A decode step's legs (chained: n + 1 a token; star: 2n) and the batch it decodes
    together (its weights read once for every sequence). The simulated client sits at the
    network's middle (a gateway), where a provider-to-provider trip costs what going through
    it does: a star step pays n - 1 more sends of the hidden states on home uplinks. A
    larger batch makes more tokens per second at a slower step."""
    from dag.cost import latency, pipeline_metrics
    from sim.catalog import profile
    from sim.workloads import served, workload

    spec = workload("llama2-7b-inference")
    home = NETWORKS["home-broadband"]
    gpu = profile(GPUS["rtx3080"], home.up_median, home.rtt)
    stages = [(gpu, 8)] * 4
    chained = pipeline_metrics(spec.model, stages, spec.work)
    star = pipeline_metrics(spec.model, stages, served(spec, "star").work, star=True)
    assert 2 * latency(gpu, None) == latency(gpu, gpu)  # (home -> middle -> home)
    hidden = spec.model.hidden_bytes_per_token * spec.work.tokens / gpu.net_bandwidth
    assert star.latency - chained.latency == pytest.approx(3 * hidden, rel=1e-6)
    assert chained.stage_times == star.stage_times  # the stages' work is the same
    one = pipeline_metrics(spec.model, stages, served(spec, batch=1).work)
    assert one.latency < chained.latency and one.throughput * 2 < chained.throughput
    assert chained.bottleneck < 16 * one.bottleneck / 2  # 16 sequences: not 16 steps' cost
    runs = {
        steps: simulate(Scenario(peers=8, hours=0.2, seed=3, steps=steps)).summary()
        for steps in ("chained", "star")
    }
    assert runs["star"]["token_latency_ms_p50"] > runs["chained"]["token_latency_ms_p50"]
    with pytest.raises(ValueError, match="steps must be one of"):
        Scenario(steps="ring")
    with pytest.raises(ValueError, match="inference workloads only"):
        Scenario(workload="llama2-7b-finetune", batch=4)


def test_pretraining_compressors_and_diloco_shrink_the_gradient_exchange() -> None:
    """Bytes each block exchanges per step: fp32, fp16, Power-SGD's P and Q (rank r), ACP-SGD's
    P or Q (half of Power-SGD's factors on average), and DiLoCo's pseudo-gradient once every H
    steps; the compressors' compute is charged; a token cost scales the progress."""
    from sim.report import assumptions
    from sim.workloads import trained, workload

    base = workload("llama2-7b-pretrain")
    m = base.model
    fp16 = base.allreduce_bytes_per_block()
    assert fp16 == m.layer_param_bytes  # the default: fp16 gradients, as before
    assert trained(base, "none").allreduce_bytes_per_block() == 2 * fp16
    factors = sum((a + b) * 4 for a, b in m.layer_matrices)
    power, acp = trained(base, "powersgd"), trained(base, "acp")
    assert power.allreduce_bytes_per_block() == 2 * (factors + m.layer_vector_values)
    assert acp.allreduce_bytes_per_block() == 2 * (factors / 2 + m.layer_vector_values)
    assert trained(base, outer_every=100).allreduce_bytes_per_block() == fp16 / 100
    assert 0 < acp.compress_flops_per_block() < power.compress_flops_per_block()
    assert base.compress_flops_per_block() == 0
    # the error feedback buffer: 2 more bytes per weight than the 16 of mixed precision
    assert acp.placed_model.layer_param_bytes == 9 * m.layer_param_bytes
    with pytest.raises(ValueError, match="compress must be one of"):
        Scenario(workload="llama2-7b-pretrain", compress="zip")
    with pytest.raises(ValueError, match="pre-training only"):
        Scenario(workload="llama2-7b-finetune", compress="acp")
    with pytest.raises(ValueError, match="rank is 1 to 1024"):
        Scenario(workload="llama2-7b-pretrain", compress="acp", rank=0)

    def run(**kw: object) -> float:
        s = Scenario(peers=50, workload="llama2-7b-pretrain", hours=0.5, seed=2, **kw)  # type: ignore[arg-type]
        return simulate(s).throughput_tokens_s

    plain, compressed = run(), run(compress="acp")
    assert compressed > plain > 0
    assert run(compress="acp", token_cost=2.0) == pytest.approx(compressed / 2, rel=0.1)
    stated = assumptions(Scenario(workload="llama2-7b-pretrain", compress="acp", outer_every=20))
    assert stated["workload"]["compress"] == "acp"
    assert stated["workload"]["exchange_gb_per_step"] == pytest.approx(
        acp.allreduce_bytes_per_block() * m.n_layers / 20 / 1e9
    )
