"""What scrapers cost a training step: the agent's exporter under 50 scrapers at 1 Hz, 10 and 200 scrapers as
fast as they can, and 1,000 half-open connections (issue #28).

The training process runs a step loop with an agent (exporter on) and, pinned to its own CPU, measures the
wall time of each step. Scrapers run in another process pinned to another CPU (``http.client`` keep-alive
connections, one thread each, 10 s timeout; "1hz": one request a second each, random phase; "max": back to
back). Each configuration is measured in paired blocks, ABBA order (no scrapers / scrapers / scrapers / none
...), each block ``--block-seconds`` of steps; the cost is the median over pairs of
(median step time with scrapers / median step time without) - 1.

``--server prometheus_client`` serves the same registry with ``prometheus_client.start_http_server`` instead
(what the agent did before #28), for the before/after comparison.

Steps: ``--device cpu`` a small MLP (1 thread: a dispatcher-bound step of about a millisecond, like a
launch-bound GPU step); ``--device cuda`` the Llama of ``benchmarks/_llama_workload.py`` (4 layers, bf16
autocast) at ``--batch``x``--seq`` with a synchronize per step.

    python benchmarks/scrape_load.py                          # CPU, the mfuwatch server, all configurations
    python benchmarks/scrape_load.py --server prometheus_client --configs 10max
    python benchmarks/scrape_load.py --device cuda --batch 1 --seq 512

Prints a table; writes ``$OUT/scrape_load.json`` (default ./out).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

CONFIGS = {"50x1hz": (50, "1hz"), "10max": (10, "max"), "200max": (200, "max"), "1000halfopen": (1000, "halfopen")}


# ----------------------------------------------------------------------------------------- scraper process
def scraper_main(n: int, mode: str, host: str, port: int, token: str) -> None:
    stop = threading.Event()
    lat: list = []
    fails = [0]
    lock = threading.Lock()
    headers = {"Authorization": f"Bearer {token}"} if token else {}

    def one(i: int) -> None:
        conn = None
        rng = random.Random(i)
        if mode == "1hz":
            stop.wait(rng.random())
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                if conn is None:
                    conn = http.client.HTTPConnection(host, port, timeout=10)
                conn.request("GET", "/metrics", headers=headers)
                resp = conn.getresponse()
                body = resp.read()
                ok = resp.status == 200 and body
            except (OSError, http.client.HTTPException):
                ok = False
                if conn is not None:
                    conn.close()
                conn = None
            dt = time.perf_counter() - t0
            with lock:
                if ok:
                    lat.append(dt)
                else:
                    fails[0] += 1
            if mode == "1hz":
                stop.wait(max(0.0, 1.0 - dt))
        if conn is not None:
            conn.close()

    held = []
    threads = []
    if mode == "halfopen":  # n idle connections, half of them with half a request; one scraper at 1 Hz
        for i in range(n):
            s = socket.create_connection((host, port))
            if i % 2:
                s.sendall(b"GET /metrics HTTP/1.1\r\n")
            held.append(s)
        mode = "1hz"
        n = 1
    for i in range(n):
        t = threading.Thread(target=one, args=(i,), daemon=True)
        t.start()
        threads.append(t)
    print("ready", flush=True)
    sys.stdin.read()  # until the parent closes our stdin
    stop.set()
    for t in threads:
        t.join(timeout=12)
    for s in held:
        s.close()
    lat.sort()
    q = (lambda p: round(lat[min(len(lat) - 1, int(p * len(lat)))] * 1e3, 2)) if lat else (lambda p: None)
    print(json.dumps({"ok": len(lat), "failed": fails[0], "p50_ms": q(0.5), "p99_ms": q(0.99)}), flush=True)


# ----------------------------------------------------------------------------------------- training process
def make_step(device: str, batch: int, seq: int):
    import torch

    if device == "cpu":
        torch.set_num_threads(1)
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)])
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        x = torch.randn(8, 64)

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            model(x).square().mean().backward()
            opt.step()

        return step, 8 * 64
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _llama_workload import make_step as llama_step

    inner = llama_step(layers=4, batch=batch, seq=seq, device="cuda")

    def step() -> None:
        inner()
        torch.cuda.synchronize()

    return step, batch * seq


def pin(cpu: int) -> None:
    try:
        os.sched_setaffinity(0, {cpu % os.cpu_count()})
    except (AttributeError, OSError):
        pass


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--server", default="mfuwatch", choices=["mfuwatch", "prometheus_client"])
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}")
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--block-seconds", type=float, default=2.0)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--train-cpu", type=int, default=0)
    ap.add_argument("--scrape-cpu", type=int, default=1)
    ap.add_argument("--token", default="", help="bearer token the exporter requires (mfuwatch server)")
    ap.add_argument("--scraper", nargs=4, metavar=("N", "MODE", "HOST", "PORT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.scraper:
        pin(args.scrape_cpu)
        n, mode, host, port = args.scraper
        scraper_main(int(n), mode, host, int(port), args.token)
        return 0

    pin(args.train_cpu)
    from mfuwatch.agent import Agent

    step, tokens = make_step(args.device, args.batch, args.seq)
    cfg = dict(run="scrape-load", nvml=False, profile_every="off", alerts=False, flops_per_step=1e9, port=0,
               progress=False, exporter=args.server == "mfuwatch")
    if args.token:
        os.environ["MFUWATCH_BENCH_TOKEN"] = args.token
        cfg["exporter_auth"] = {"type": "bearer", "token_env": "MFUWATCH_BENCH_TOKEN"}
    agent = Agent(config=cfg)
    legacy = None
    if args.server == "mfuwatch":
        port = int(agent.exporter_url.rsplit(":", 1)[1].split("/")[0])
    else:
        from prometheus_client import start_http_server

        legacy = start_http_server(0, addr="127.0.0.1", registry=agent.exporter.exposed_registry)
        port = legacy[0].server_address[1]
    for _ in range(50):  # warm-up
        step()
        agent.step(tokens=tokens)

    def block(seconds: float) -> list:
        times = []
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            step()
            agent.step(tokens=tokens)
            times.append(time.perf_counter() - t0)
        return times

    def scrapers(n: int, mode: str):
        proc = subprocess.Popen([sys.executable, __file__, "--scrape-cpu", str(args.scrape_cpu), "--token",
                                 args.token, "--scraper", str(n), mode, "127.0.0.1", str(port)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(0.5 if mode != "1hz" else 1.2)  # all scrapers in their steady state
        return proc

    results = {}
    for name in filter(None, args.configs.split(",")):
        n, mode = CONFIGS[name]
        ratios, base_meds, load_meds, stats = [], [], [], []
        threads_seen = []
        cpu_shares: list = []
        for i in range(args.pairs):
            order = ("base", "load") if i % 2 == 0 else ("load", "base")
            meds = {}
            for kind in order:
                if kind == "base":
                    meds[kind] = statistics.median(block(args.block_seconds))
                else:
                    proc = scrapers(n, mode)
                    srv = getattr(agent.exporter, "_server", None)
                    c0, w0 = (srv.cpu_seconds if srv else 0.0), time.perf_counter()
                    meds[kind] = statistics.median(block(args.block_seconds))
                    if srv is not None:
                        cpu_shares.append((srv.cpu_seconds - c0) / (time.perf_counter() - w0))
                    threads_seen.append(threading.active_count())
                    out, _ = proc.communicate(input="", timeout=60)
                    stats.append(json.loads(out.strip().splitlines()[-1]))
            ratios.append(meds["load"] / meds["base"])
            base_meds.append(meds["base"])
            load_meds.append(meds["load"])
        ok = sum(s["ok"] for s in stats)
        failed = sum(s["failed"] for s in stats)
        results[name] = {
            "cost": statistics.median(ratios) - 1.0, "ratios": [round(r, 4) for r in ratios],
            "base_step_ms": round(statistics.median(base_meds) * 1e3, 3),
            "load_step_ms": round(statistics.median(load_meds) * 1e3, 3),
            "scrapes_per_s": round(ok / (args.pairs * args.block_seconds), 1), "failed": failed,
            "p50_ms": statistics.median([s["p50_ms"] for s in stats if s["p50_ms"] is not None] or [0]),
            "p99_ms": max([s["p99_ms"] for s in stats if s["p99_ms"] is not None] or [0]),
            "threads": max(threads_seen),
            "server_cpu_share": round(statistics.median(cpu_shares), 4) if cpu_shares else None,
        }
        print(f"{name}: {results[name]}", flush=True)
    agent.close()
    if legacy is not None:
        legacy[0].shutdown()
    print(f"\nserver={args.server} device={args.device} pairs={args.pairs} block={args.block_seconds}s "
          f"(training pinned to CPU {args.train_cpu}, scrapers to CPU {args.scrape_cpu})")
    print(f"{'config':<14} {'step ms (none)':>14} {'step ms (load)':>14} {'cost':>8} {'scrapes/s':>10} "
          f"{'failed':>7} {'p50 ms':>8} {'p99 ms':>8} {'threads':>8} {'server CPU':>10}")
    for k, r in results.items():
        print(f"{k:<14} {r['base_step_ms']:>14} {r['load_step_ms']:>14} {r['cost'] * 100:>7.2f}% "
              f"{r['scrapes_per_s']:>10} {r['failed']:>7} {r['p50_ms']:>8} {r['p99_ms']:>8} {r['threads']:>8} "
              + (f"{r['server_cpu_share'] * 100:>9.2f}%" if r['server_cpu_share'] is not None else f"{'n/a':>10}"))
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"scrape_load_{args.server}_{args.device}.json").write_text(json.dumps(
        {"args": vars(args), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
