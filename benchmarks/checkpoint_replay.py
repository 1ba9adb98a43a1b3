"""Issue 24's checkpoint incident, replayed on a GPU: does either alert path page?

An HF Llama built from a config (8 layers, d=2048, GQA 16/4, ff 5632, V=32000; batch 4 x 2048, bf16 autocast,
foreach AdamW) trains for ``--train1`` seconds with the agent attached (``mfuwatch.agent.watch``, exporter on,
built-in rules with ``MfuAboveTensorActivity``'s ``for`` shortened to ``--for``), then spends ``--phase``
seconds in ``agent.phase("checkpoint")`` with the GPU idle (a ``torch.save`` of the weights to /dev/shm and a
sleep for the rest: the GPU does nothing), then trains ``--train2`` more seconds. A thread scrapes the agent's
``/metrics`` every ``--scrape`` seconds for the whole run. The in-process engine must not fire
(``mfuwatch_alerts_firing`` stays 0 for every rule, no ``FIRING`` line on stderr).

Writes (under ``$OUT``, or ``--out``): ``checkpoint_replay.jsonl.gz`` (one JSON line per scrape:
``{"t": unix seconds, "text": exposition}``) and ``checkpoint_replay.md`` (the timeline and the verdict). The
Prometheus half runs on any machine afterwards: ``python -m tests.incidents.real_series FILE`` evaluates the
shipped rules over the scraped series with ``promtool test rules`` (tests/incidents/real_series.py).

    python3 benchmarks/checkpoint_replay.py                 # H200: ~75 s
    python3 benchmarks/checkpoint_replay.py --cpu --tiny --train1 4 --phase 6 --train2 3   # plumbing check
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import sys
import threading
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

P = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
P.add_argument("--train1", type=float, default=15.0, help="seconds of training before the phase (default 15)")
P.add_argument("--phase", type=float, default=45.0, help="seconds in agent.phase('checkpoint') (default 45)")
P.add_argument("--train2", type=float, default=10.0, help="seconds of training after it (default 10)")
P.add_argument("--tail", type=float, default=5.0, help="seconds of scraping after the last step (default 5)")
P.add_argument("--for", dest="for_s", default="20s", help="MfuAboveTensorActivity's for (default 20s)")
P.add_argument("--scrape", type=float, default=1.0, help="scrape interval in seconds (default 1)")
P.add_argument("--port", type=int, default=9478, help="exporter port (default 9478)")
P.add_argument("--cpu", action="store_true", help="run on the CPU")
P.add_argument("--tiny", action="store_true", help="a 2-layer d=64 model (plumbing check)")
P.add_argument("--out", default=os.environ.get("OUT", "."), help="output folder (default $OUT or .)")

_FIRING = re.compile(r'^mfuwatch_alerts_firing\{([^}]*)\} (\S+)$', re.M)


class Scraper(threading.Thread):
    """GET ``url`` every ``every`` seconds; each reply kept as ``(unix seconds, text)`` (failures counted)."""

    def __init__(self, url: str, every: float) -> None:
        super().__init__(daemon=True)
        self.url, self.every = url, every
        self.samples: list = []
        self.failed = 0
        self.stop = threading.Event()

    def run(self) -> None:
        nxt = time.monotonic()
        while not self.stop.is_set():
            try:
                with urllib.request.urlopen(self.url, timeout=2) as r:
                    self.samples.append((time.time(), r.read().decode()))
            except Exception:  # noqa: BLE001  (the exporter is not up yet, or gone)
                self.failed += 1
            nxt += self.every
            self.stop.wait(max(0.0, nxt - time.monotonic()))


def main() -> int:
    args = P.parse_args()
    import torch

    from gain_truth import build
    from mfuwatch.agent import watch

    dev = "cpu" if args.cpu else "cuda"
    model, ids = build("llama", args.tiny, dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    autocast = torch.autocast(dev, dtype=torch.bfloat16, enabled=dev == "cuda")
    rules = {"MfuAboveTensorActivity": {"for": args.for_s}}
    agent = watch(model, opt, port=args.port, alerts={"rules": rules})
    scraper = Scraper(f"http://127.0.0.1:{args.port}/metrics", args.scrape)
    scraper.start()
    events = []
    t0 = time.time()

    def train(seconds: float) -> int:
        n, end = 0, time.monotonic() + seconds
        while time.monotonic() < end:
            with autocast:
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            n += 1
            if dev == "cuda" and n % 10 == 0:
                torch.cuda.synchronize()  # the loop does not run ahead of the GPU by more than 10 steps
        if dev == "cuda":
            torch.cuda.synchronize()
        return n

    n1 = train(args.train1)
    events.append(("phase begins", time.time() - t0, n1))
    with agent.phase("checkpoint"):
        end = time.monotonic() + args.phase
        path = "/dev/shm/checkpoint_replay.pt" if os.path.isdir("/dev/shm") else "checkpoint_replay.pt"
        torch.save({k: v.detach().to("cpu") for k, v in model.state_dict().items()}, path)
        os.remove(path)
        time.sleep(max(0.0, end - time.monotonic()))  # the GPU is idle for the rest of the phase
    events.append(("phase ends", time.time() - t0, 0))
    n2 = train(args.train2)
    events.append(("training ends", time.time() - t0, n2))
    time.sleep(args.tail)
    scraper.stop.set()
    scraper.join()
    agent.close()

    firing = {}
    for t, text in scraper.samples:
        for labels, v in _FIRING.findall(text):
            if float(v) > 0:
                name = dict(re.findall(r'(\w+)="([^"]*)"', labels)).get("alertname", labels)
                firing.setdefault(name, []).append(round(t - t0, 1))
    os.makedirs(args.out, exist_ok=True)
    with gzip.open(os.path.join(args.out, "checkpoint_replay.jsonl.gz"), "wt") as f:
        for t, text in scraper.samples:
            f.write(json.dumps({"t": t, "text": text}) + "\n")
    name = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
    lines = [f"# Checkpoint incident replay ({name}, torch {torch.__version__})", "",
             f"MfuAboveTensorActivity for: {args.for_s}; scrapes: {len(scraper.samples)} "
             f"(every {args.scrape:g} s, {scraper.failed} failed)", "",
             "| event | at (s) | steps before |", "|---|---|---|"]
    lines += [f"| {e} | {at:.1f} | {n} |" for e, at, n in events]
    verdict = ("in-process engine: no alert fired" if not firing else
               "in-process engine FIRED: " + "; ".join(f"{k} at {v[0]}..{v[-1]} s" for k, v in firing.items()))
    lines += ["", verdict, ""]
    text = "\n".join(lines)
    print(text, flush=True)
    with open(os.path.join(args.out, "checkpoint_replay.md"), "w") as f:
        f.write(text + "\n")
    return 1 if firing else 0


if __name__ == "__main__":
    sys.exit(main())
