"""Home-internet benchmark: a 3-stage generation and an embedding job through the lab (root).

    sudo python benchmarks/internet.py [--tokens 32] [--microbatches 16]

Builds the home-internet lab (`lab/`): a broker on the Internet, three providers in three
homes behind UPnP routers and a client in a fourth home behind a cone NAT, every home's
access link at 20 Mbit/s and 25 ms one way (home to home: 50 ms). Each route kind runs with a
fresh broker and the same three providers (one compute thread each):

    direct        the providers map a port on their routers (UPnP) and are dialled there
    relayed       they ask for no mapping (--no-upnp) and punch no holes (--no-punch), so
                  they are reached through the broker's relay (every client and
                  provider-to-provider leg crosses it)
    hole_punched  no mapping either, but punching on: the client and each provider that
                  reached a provider through the relay punch a direct connection to it (the
                  routers are cone NATs underneath), and the traffic goes there

Prints one JSON object: `routes`, an object per route kind with
    token_ms         p50 time per generated token (greedy, batch 1, a 3-stage decoder), the
                     client in its home driving the session, its steps chained (client ->
                     each stage's provider in turn -> client); `chained` counts those steps
    token_floor_ms   the sum over that token's legs (a relayed leg is two legs, to the relay
                     and from it) of one-way latency plus bytes over the slowest link, plus
                     all stages' compute for one token measured in this process (one thread)
    token_ms_star, token_floor_star_ms   the same with the client's steps to each stage and
                     back (`Client(chain=False)`): 2n legs a token where the chain has n + 1
    texts_s          texts/s of a batch job of --microbatches x 32 texts x 128 tokens
                     (3-stage all-MiniLM-L6-v2, activations chained provider to provider),
                     cut into microbatches by the broker (`job_microbatches`; --microbatch
                     and --in-flight force them)
    texts_ceiling_s  the lesser of the stages' texts/s in this process with the serving
                     providers' total threads, and over the access links, bandwidth over the
                     bytes per text the job's legs put on that link
    spot_checks      the broker's checks during the embedding jobs (the warm-up's too), by
                     event: `result_checked`, `check_skipped`, `provider_quarantined`
                     (`--verify-fraction`, default 0.05: chained hops are checked against
                     their signed accounts, in the chain)
    token_ratio, texts_ratio   the measure over its bound (targets: token_ratio <= 1.3,
                     texts_ratio >= 0.75)
    placement        which provider (p0..p2, by home) serves each stage of each model
and `hole_punch_success`: the fraction of the punches tried on the hole-punched route (the
client's to each provider, and each provider's to the next hop of a chain) that ended in a
direct connection; `punches` lists them (who, to whom, seconds, or why not).
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.procs and lab: the helpers the lab tests use

import numpy as np  # noqa: E402
from e2e import BATCH, SEQ, _ids, decoder_model, embed_local, token_local  # noqa: E402

from lab.net import missing  # noqa: E402
from lab.topology import BROKER_IP, Lab  # noqa: E402
from tests.procs import Proc, fusionai  # noqa: E402

STAGES = 3
CLIENT = """
import json, sys, time, urllib.request
import numpy as np
from client import Client
url, package, mode, tokens, ids, size = sys.argv[1:7]
with Client(url, timeout=120) as fa:
    name = fa.add_model(package).model
    end = time.monotonic() + 300
    while not fa.model(name).ready:
        assert time.monotonic() < end, "the model was never served"
        time.sleep(0.5)
    out = {"placement": [s.providers[0].peer_id for s in fa.model(name).stages]}
    punched = lambda: [(p, o.direct, o.seconds, o.reason) for p, o in fa._async._puncher.outcomes]
    if mode == "generate":
        prompt = list(range(1, 9))
        for _ in range(2):  # connections and sessions warm
            fa.generate(prompt, 5, stream=False, model=name)
        run = fa.generate(prompt, int(tokens), stream=False, model=name)  # (alone: chained)
        out["token_ms"] = float(np.median(np.diff(run.token_times))) * 1e3
        out["chained"] = run.chained
        with Client(url, timeout=120, chain=False) as star:  # to each stage and back
            for _ in range(2):
                star.generate(prompt, 5, stream=False, model=name)
            run = star.generate(prompt, int(tokens), stream=False, model=name)
        out["token_ms_star"] = float(np.median(np.diff(run.token_times))) * 1e3
        out["punches"] = punched() if fa._async._puncher else []
    else:
        ids = json.load(open(ids))
        cut = {"microbatch": int(size)} if int(size) else {}  # (none: the broker sizes them)
        fa.wait(fa.submit({"model": name, "token_ids": ids[:32], **cut}).id)
        start = time.perf_counter()
        job = fa.submit({"model": name, "token_ids": ids, **cut})
        done = fa.wait(job.id)
        assert done.state == "succeeded"
        out["texts_s"] = len(ids) / (time.perf_counter() - start)
        out["job_microbatches"] = done.microbatches
        with urllib.request.urlopen(url + "/v1/events?limit=10000", timeout=30) as resp:
            kinds = [e["kind"] for e in json.load(resp)["events"]]
        out["spot_checks"] = {k: kinds.count(k) for k in ("result_checked", "check_skipped",
                              "provider_quarantined")}  # fmt: skip
print(json.dumps(out))
"""


def packages(tmp: Path) -> dict[str, Path]:
    """A random 8-block Llama (hidden 256, no end-of-sequence token) and all-MiniLM-L6-v2,
    each cut into 3 provider stages."""
    from cli.demo_models import build_minilm
    from ir.export import build_package

    out = {"decoder": tmp / "decoder", "minilm": tmp / "minilm"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        build_package(decoder_model(), STAGES, out["decoder"], name="decoder")
    build_minilm(out["minilm"], STAGES, name="minilm")
    return out


def hop_bytes(package: Path, batch: int, step: bool) -> list[float]:
    """Bytes per text (per token when `step`) into each provider stage and back out of the
    last, as the pipeline in this process hands them over (hidden states, plus the attention
    mask or positions the stage also gets)."""
    from ir.executors.ort import OrtExecutor
    from ir.package import load_package
    from ir.pipeline import LocalPipeline

    pkg = load_package(package)
    seen: list[int] = []

    def hop(hidden: Any) -> Any:
        seen.append(hidden.nbytes)
        return hidden

    runs = [OrtExecutor(pkg.models[s.index]) for s in pkg.manifest.stages]
    pipe = LocalPipeline(pkg.manifest, runs, hop=hop)
    if step:
        pipe.step(np.array([[5]], dtype=np.int64), 0, pipe.new_cache())
        extra = 8  # position ids
    else:
        ids = _ids(batch, 30522, seed=1)
        pipe.encode(ids, np.ones_like(ids))
        extra = SEQ * 8  # the attention mask (int64)
    return [(n + (extra if i < len(seen) - 1 else 0)) / batch for i, n in enumerate(seen)]


class Legs:
    """One-way times and link loads of the legs a route's traffic takes. Endpoints are
    'client', 'broker' or a provider index; every home's access link is `delay_s` one way
    and `rate` bytes/s each way, the broker's (and its relay's) unlimited."""

    def __init__(self, delay_s: float, rate: float, relayed: bool) -> None:
        self.delay_s, self.rate, self.relayed = delay_s, rate, relayed
        self.load: dict[tuple[str, str], float] = defaultdict(float)  # (dir, home): bytes

    def leg(self, src: str, dst: str, nbytes: float) -> float:
        """Seconds for `nbytes` from src to dst (as floor), adding them to the links' load.
        A home-to-home leg through the relay is two legs: to the relay, then from it."""
        homes = [e for e in (src, dst) if e != "broker"]
        if src in homes:
            self.load[("up", src)] += nbytes
        if dst in homes:
            self.load[("down", dst)] += nbytes
        if len(homes) < 2:  # to or from the broker: one access link
            return self.delay_s + nbytes / self.rate
        if self.relayed:
            return 2 * (self.delay_s + nbytes / self.rate)
        return 2 * self.delay_s + nbytes / self.rate

    def ceiling(self) -> float:
        """Texts/s the links allow when `load` is bytes per text."""
        return min(self.rate / b for b in self.load.values()) if self.load else float("inf")


def run_route(lab: Lab, tmp: Path, kind: str, package: Path, args: Any) -> dict[str, Any]:
    """A fresh broker and the three providers, reached on route `kind`; the client in the
    fourth home adds `package` (a provider serves one model at a time) and measures it."""
    procs: list[Proc] = []
    mode = "generate" if package.name == "decoder" else "embed"
    try:
        broker = Proc(["ip", "netns", "exec", lab.broker, *fusionai(
            "broker", "start", "--listen", "/ip4/0.0.0.0/tcp/7370", "--http", "0.0.0.0:7371",
            "--public-url", f"http://{BROKER_IP}:7371", "--data-dir", str(tmp / f"{kind}-{mode}"),
            "--heartbeat-s", "1", "--trust-claims", "--json", *args.broker_arg,
            *(("--in-flight", str(args.in_flight)) if args.in_flight else ()),
        )])  # fmt: skip
        flags = {"direct": (), "relayed": ("--no-upnp", "--no-punch"),
                 "hole_punched": ("--no-upnp",)}[kind]  # fmt: skip
        procs.append(broker)
        peer = broker.wait_for("broker_started", timeout=60)["peer"]
        addr = f"/ip4/{BROKER_IP}/tcp/7370/p2p/{peer}"
        names = {}
        for i, home in enumerate(lab.homes[:3]):
            proc = Proc(["ip", "netns", "exec", home.host, *fusionai(
                "provider", "start", "--broker", addr, "--data-dir", str(tmp / f"p{i}"),
                "--listen", "/ip4/0.0.0.0/tcp/4900", "--max-memory", "2", "--json", *flags,
            )])  # fmt: skip
            procs.append(proc)
            names[proc.wait_for("listening", timeout=180)["peer_id"]] = f"p{i}"
        want = "mapped" if kind == "direct" else "relayed"
        for peer in names:
            seen = broker.wait_for("provider_reach", lambda e, p=peer: e["peer"] == p
                                   and e["reach"] != "unreachable", timeout=180)  # fmt: skip
            if seen["reach"] != want:
                raise RuntimeError(f"{kind}: a provider is {seen['reach']}, not {want}")
        out = lab.run(lab.homes[3].host, sys.executable, "-c", CLIENT, f"http://{BROKER_IP}:7371",
                      str(package), mode, str(args.tokens), str(tmp / "ids.json"),
                      str(args.microbatch), timeout=900)  # fmt: skip
        answer: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
        answer["placement"] = [names.get(p, p) for p in answer["placement"]]
        answer["punches"] = [
            {"from": "client", "to": names.get(p, p), "direct": bool(d), "seconds": round(t, 3),
             "why_not": why} for p, d, t, why in answer.get("punches", [])
        ]  # fmt: skip
        for peer, proc in zip(names, procs[1:], strict=True):
            proc.drain_events()
            answer["punches"] += [
                {"from": names[peer], "to": names.get(e["peer"], e["peer"]),
                 "direct": bool(e["direct"]), "seconds": e["seconds"], "why_not": e["reason"]}
                for e in proc.events if e["event"] == "punched"
            ]  # fmt: skip
        return answer
    finally:
        for proc in reversed(procs):  # providers first, so that they remove their mappings
            proc.signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.stop()


def bounds(
    kind: str, placement: dict[str, list[str]], local: dict[str, Any], lab: Lab
) -> dict[str, float]:
    """The floor of a token and the ceiling of texts/s on this route's legs."""
    delay, rate = lab.delay_ms / 1e3, lab.rate_mbit * 1e6 / 8
    tokens = Legs(delay, rate, kind == "relayed")
    floor = star = local["token_ms"] / 1e3
    hops = ["client", *placement["decoder"], "client"]  # a chained step: stage to stage
    for i, (src, dst) in enumerate(itertools.pairwise(hops)):
        floor += tokens.leg(src, dst, local["token_bytes"][i]) if src != dst else 0.0
    for i, p in enumerate(placement["decoder"]):  # the star: to each stage and back
        star += tokens.leg("client", p, local["token_bytes"][i])
        star += tokens.leg(p, "client", local["token_bytes"][i + 1])
    texts = Legs(delay, rate, kind == "relayed")
    chain = ["broker", *placement["minilm"], "broker"]  # the broker sends, providers chain
    for i, (src, dst) in enumerate(itertools.pairwise(chain)):
        if src != dst:
            texts.leg(src, dst, local["text_bytes"][i])
    if not placement["minilm"]:  # (--generate-only)
        return {"token_floor_ms": floor * 1e3, "token_floor_star_ms": star * 1e3,
                "texts_ceiling_s": float("nan")}  # fmt: skip
    compute = local["texts_s"][len(set(placement["minilm"]))]
    return {
        "token_floor_ms": floor * 1e3,
        "token_floor_star_ms": star * 1e3,
        "texts_ceiling_s": min(compute, texts.ceiling()),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=32, help="generated per timed run")
    parser.add_argument("--microbatches", type=int, default=16, help="of 32 x 128 per job")
    parser.add_argument(
        "--microbatch",
        type=int,
        default=0,
        help="texts per microbatch the job asks for (0: none, the broker sizes them)",
    )
    parser.add_argument(
        "--routes", default="direct,relayed,hole_punched", help="route kinds to run (profiling)"
    )
    parser.add_argument(
        "--in-flight",
        type=int,
        default=0,
        help="the broker's microbatches in flight (0: its own, from the route)",
    )
    parser.add_argument("--embed-only", action="store_true", help="skip the generation (profiling)")
    parser.add_argument(
        "--generate-only", action="store_true", help="skip the embedding job (profiling)"
    )
    parser.add_argument(
        "--broker-arg", action="append", default=[], help="more `broker start` flags"
    )
    args = parser.parse_args()
    unknown = set(args.routes.split(",")) - {"direct", "relayed", "hole_punched"}
    if unknown or args.microbatch < 0 or args.in_flight < 0:
        parser.error(f"unknown routes {sorted(unknown)}" if unknown else "negative count")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the lab is torn down
    why = missing()
    if why:  # (`make bench` goes on with the others)
        print(json.dumps({"routes": None, "hole_punch_success": None, "skipped": why}))
        return 0
    tmp = Path(tempfile.mkdtemp(prefix="fusionai-internet-"))
    try:
        pkgs = packages(tmp)
        ids = _ids(BATCH * args.microbatches, 30522, seed=1)
        (tmp / "ids.json").write_text(json.dumps(ids.tolist()))
        local = {
            "token_ms": token_local(pkgs["decoder"], 64),
            "texts_s": {
                n: embed_local(pkgs["minilm"], args.microbatches, threads=n)[0]
                for n in range(1, STAGES + 1)
                if not args.generate_only
            },
            "token_bytes": hop_bytes(pkgs["decoder"], 1, step=True),
            "text_bytes": hop_bytes(pkgs["minilm"], BATCH, step=False),
        }
        routes: dict[str, Any] = {}
        with Lab(["upnp", "upnp", "upnp", "cone"], rate_mbit=20, delay_ms=25) as lab:
            for kind in args.routes.split(","):
                got = {"token_ms": float("nan"), "placement": ["p0", "p1", "p2"], "punches": []}
                if not args.embed_only:
                    got = run_route(lab, tmp, kind, pkgs["decoder"], args)
                embed = {"texts_s": float("nan"), "placement": [], "punches": []}
                if not args.generate_only:
                    embed = run_route(lab, tmp, kind, pkgs["minilm"], args)
                got["texts_s"] = embed["texts_s"]
                punches = [*got["punches"], *embed["punches"]]
                got["placement"] = {"decoder": got["placement"], "minilm": embed["placement"]}
                bound = bounds(kind, got["placement"], local, lab)
                routes[kind] = {
                    "token_ms": round(got["token_ms"], 1),
                    "token_floor_ms": round(bound["token_floor_ms"], 1),
                    "token_ratio": round(got["token_ms"] / bound["token_floor_ms"], 3),
                    "token_ms_star": round(got.get("token_ms_star", float("nan")), 1),
                    "token_floor_star_ms": round(bound["token_floor_star_ms"], 1),
                    "chained": got.get("chained"),
                    "texts_s": round(got["texts_s"], 2),
                    "texts_ceiling_s": round(bound["texts_ceiling_s"], 2),
                    "texts_ratio": round(got["texts_s"] / bound["texts_ceiling_s"], 3),
                    "job_microbatches": embed.get("job_microbatches"),
                    "spot_checks": embed.get("spot_checks"),
                    "placement": got["placement"],
                    "punches": punches,
                }
        tried = routes.get("hole_punched", {}).get("punches", [])
        success = sum(p["direct"] for p in tried) / len(tried) if tried else None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps({
        "routes": routes,
        "hole_punch_success": success,
        "local": {"token_ms": round(local["token_ms"], 2),
                  "texts_s": {str(k): round(v, 1) for k, v in local["texts_s"].items()},
                  "token_bytes": local["token_bytes"], "text_bytes": local["text_bytes"]},
        "tokens": args.tokens,
        "microbatches": args.microbatches,
        "microbatch": args.microbatch,
        "in_flight": args.in_flight,
    }))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
