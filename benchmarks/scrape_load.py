"""What scrapers cost a training step: the agent's exporter under 50 scrapers at 1 Hz, 10 and 200 scrapers as
fast as they can, and 1,000 half-open connections (issue #28).

The training process runs a step loop with an agent (exporter on) and, pinned to its own CPU, measures the
wall time of each step. Scrapers run in another process pinned to another CPU (``http.client`` keep-alive
connections, one thread each, 10 s timeout; "1hz": one request a second each, random phase; "max": back to
back). Each configuration is measured in paired blocks, ABBA order (no scrapers / scrapers / scrapers / none
...), each block ``--block-seconds`` of steps, the configurations interleaved (one pair of each per round,
``--pairs`` rounds); the cost is the median over pairs of (median step time with scrapers / median step
time without) - 1, printed with the pairs' min..max. The same ratio of the training thread's CPU time per
step (``time.thread_time``) is printed too: on a machine shared with other jobs the wall time also
counts their preemptions, the CPU time does not (but it misses time spent waiting for the interpreter
lock, which the wall time shows). Also printed: the server's CPU share (the server child's utime+stime
from /proc in process mode, the loop thread's in thread mode), the training process's CPU share, thread
and open-descriptor counts (training process + server child).

``--mode process`` (default) serves from the server child process (``exporter_server: process``),
``--mode thread`` from the in-process event-loop thread.

``--server-cpu N`` places the server child on CPU N with ``exporter_server_cpus`` (every thread of it);
``--server-cpu-main-only`` instead moves only its main thread from outside, as runs 2 and 3 did by mistake
(the loop thread, which serves, stayed on the training CPU). ``10static`` is a control that is not
mfuwatch: 10 scrapers as fast as they can against a trivial ``http.server`` in another process (on
``--server-cpu``), serving bytes of the exposition's size.

Where the time goes: per arm (idle and loaded) a :class:`Probe` reads the training thread's CPU time and
run-queue wait (schedstat) and context switches, every thread's CPU time by name, the training CPU's
interrupts and softirqs, and the publisher thread's wake-ups, renders and the lines it read from the child;
the second table prints their medians, idle -> loaded. A third prints a 95% bootstrap interval of each
median pair ratio; ``--pool A.json B.json`` pools the pair ratios of several runs.

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

CONFIGS = {"50x1hz": (50, "1hz"), "10max": (10, "max"), "200max": (200, "max"), "1000halfopen": (1000, "halfopen"),
           "10static": (10, "max")}
#: configurations whose scrapers hit a trivial static server (another process, not mfuwatch's), not the agent
STATIC = {"10static"}


# ----------------------------------------------------------------------------------------- static server process
def static_main(nbytes: int) -> None:
    """The control's server: ``http.server`` answering every GET with the same ``nbytes`` bytes (keep-alive), a
    thread per connection, no CPU cap. Prints its port, serves until stdin's EOF."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    body = (b"# static control\n" + b"x" * max(0, nbytes - 18) + b"\n")[:max(1, nbytes)]

    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self):  # noqa: N802 - http.server's name
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):  # quiet
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    print(srv.server_address[1], flush=True)
    sys.stdin.read()
    srv.shutdown()


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


def _proc_cpu(pid: int) -> float:
    """utime + stime of process ``pid`` in seconds (/proc/PID/stat), 0.0 where unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def _proc_threads(pid) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Threads:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _proc_fds(pid) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


# ----------------------------------------------------------------------------------------- where the time goes
def _task_sched(pid, tid) -> tuple:
    """(run ns, run-queue wait ns) of a task from /proc/PID/task/TID/schedstat (0, 0 where unreadable)."""
    try:
        with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
            run, wait, _slices = f.read().split()
        return int(run), int(wait)
    except (OSError, ValueError):
        return 0, 0


def _task_ctx(pid, tid) -> tuple:
    """(voluntary, involuntary) context switches of a task (/proc/PID/task/TID/status)."""
    v = nv = 0
    try:
        with open(f"/proc/{pid}/task/{tid}/status") as f:
            for line in f:
                if line.startswith("voluntary_ctxt_switches"):
                    v = int(line.split()[1])
                elif line.startswith("nonvoluntary_ctxt_switches"):
                    nv = int(line.split()[1])
    except (OSError, ValueError):
        pass
    return v, nv


def _task_cpus(pid) -> dict:
    """{tid: (allowed CPUs as the kernel lists them, the CPU it last ran on)} for every task of ``pid``."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                allowed = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("Cpus_allowed_list")), "?")
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                last = int(f.read().rsplit(")", 1)[1].split()[36])
        except (OSError, ValueError, IndexError):
            continue
        out[int(tid)] = (allowed, last)
    return out


def _comm(pid, tid) -> str:
    """The kernel's name of a task that is not a Python thread (CUDA's and torch's threads name themselves)."""
    try:
        with open(f"/proc/{pid}/task/{tid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "other"


def _per_cpu(path: str, cpu: int) -> dict:
    """The column of CPU ``cpu`` in /proc/softirqs or /proc/interrupts: {row label: count}."""
    out = {}
    try:
        with open(path) as f:
            head = f.readline().split()
            col = head.index(f"CPU{cpu}")
            for line in f:
                parts = line.split()
                if len(parts) > col + 1 and parts[col + 1].isdigit():
                    out[parts[0].rstrip(":")] = int(parts[col + 1])
    except (OSError, ValueError):
        pass
    return out


class Probe:
    """Counters of the training process read before and after an arm; :meth:`rates` gives them per wall second.

    The training thread: CPU time (``run``) and run-queue wait (``wait``: runnable but another task had its
    CPU) from schedstat, voluntary and involuntary context switches; every task of the process: CPU time,
    by thread name (the kernel's name for tasks that are not Python threads: torch's autograd worker, CUDA's); the training CPU's
    softirqs (by kind) and interrupts; the server child's and the control server's CPU time; the publisher
    thread's wake-ups, renders, lines read from the child and frames sent to it.
    """

    def __init__(self, train_cpu: int, srv, pids: dict) -> None:
        self.cpu, self.srv, self.pids = train_cpu, srv, pids
        self.pid, self.tid = os.getpid(), threading.get_native_id()

    def snap(self) -> dict:
        names = {t.native_id: t.name for t in threading.enumerate()}
        threads: dict = {}
        for tid in os.listdir(f"/proc/{self.pid}/task"):
            t = int(tid)
            name = "training" if t == self.tid else names.get(t) or _comm(self.pid, t)
            threads[name] = threads.get(name, 0) + _task_sched(self.pid, t)[0]
        run, wait = _task_sched(self.pid, self.tid)
        vol, invol = _task_ctx(self.pid, self.tid)
        srv = self.srv
        s = {"t": time.perf_counter(), "run": run, "wait": wait, "vcsw": vol, "ivcsw": invol,
             "threads": threads, "softirq": _per_cpu("/proc/softirqs", self.cpu),
             "irq": sum(_per_cpu("/proc/interrupts", self.cpu).values())}
        for k, pid in self.pids.items():
            s[k] = _proc_cpu(pid) if pid is not None else 0.0
        if srv is not None and hasattr(srv, "wakeups"):
            s.update(wakeups=srv.wakeups, renders=srv.renders, frames=srv.frames_sent,
                     lines=sum(srv.lines_received.values()))
        return s

    @staticmethod
    def rates(a: dict, b: dict) -> dict:
        """Per wall second between snapshots ``a`` and ``b`` (times as shares of a second, counts as counts)."""
        dt = b["t"] - a["t"]
        r = {"wait": (b["wait"] - a["wait"]) / 1e9 / dt, "run": (b["run"] - a["run"]) / 1e9 / dt}
        for k in ("vcsw", "ivcsw", "irq", "wakeups", "renders", "frames", "lines"):
            if k in a:
                r[k] = (b[k] - a[k]) / dt
        for k in ("child_cpu", "static_cpu"):
            if k in a:
                r[k] = (b[k] - a[k]) / dt
        r["softirq"] = {k: (b["softirq"].get(k, 0) - v) / dt for k, v in a["softirq"].items()}
        r["threads"] = {k: (b["threads"].get(k, 0) - v) / 1e9 / dt for k, v in a["threads"].items()}
        return r


def _median_rates(rs: list) -> dict:
    """The per-key median of a list of :meth:`Probe.rates` dicts (nested dicts key by key)."""
    if not rs:
        return {}
    out = {}
    for k, v in rs[0].items():
        if isinstance(v, dict):
            out[k] = {kk: round(statistics.median(r[k].get(kk, 0.0) for r in rs), 6) for kk in v}
        else:
            out[k] = round(statistics.median(r.get(k, 0.0) for r in rs), 6)
    return out


def _boot_ci(xs: list, n: int = 4000, seed: int = 0) -> tuple:
    """A 95% percentile-bootstrap interval of the median of ``xs`` (``n`` resamples): (lo, hi) or (None, None)."""
    if len(xs) < 4:
        return None, None
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(n))
    return meds[int(0.025 * n)], meds[int(0.975 * n) - 1]


def _spread(xs: list) -> str:
    """min..max of a list of ratios, as percentages of cost."""
    return f"{(min(xs) - 1) * 100:+.1f}..{(max(xs) - 1) * 100:+.1f}%" if xs else "n/a"


def _iqr(xs: list) -> str:
    """The interquartile range of a list of ratios, as percentages of cost."""
    if len(xs) < 4:
        return "n/a"
    q = statistics.quantiles(xs, n=4)
    return f"{(q[0] - 1) * 100:+.1f}..{(q[2] - 1) * 100:+.1f}%"


def pool(paths: list) -> int:
    """Pool the pair ratios of several ``scrape_load_*.json`` files (same command, separate runs) per configuration."""
    ratios: dict = {}
    for p in paths:
        for name, r in json.loads(Path(p).read_text())["results"].items():
            ratios.setdefault(name, []).extend(r["ratios"])
    print(f"pooled over {len(paths)} files: cost = median pair ratio - 1, IQR, 95% bootstrap interval of the median")
    for name, xs in ratios.items():
        lo, hi = _boot_ci(xs)
        ci = f"[{(lo - 1) * 100:+.2f}..{(hi - 1) * 100:+.2f}%]" if lo is not None else "n/a"
        print(f"  {name:<14} {(statistics.median(xs) - 1) * 100:+.2f}%  IQR {_iqr(xs):>16}  CI {ci:>18}  ({len(xs)} pairs)")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--server", default="mfuwatch", choices=["mfuwatch", "prometheus_client"])
    ap.add_argument("--mode", default="process", choices=["process", "thread"],
                    help="the agent's exporter_server (mfuwatch server): a server child process or the in-process thread")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}")
    ap.add_argument("--pairs", type=int, default=6)
    ap.add_argument("--block-seconds", type=float, default=2.0)
    ap.add_argument("--toggle", type=int, default=0, metavar="PAIRS",
                    help="per round, start the scrapers once and alternate PAIRS pairs of --arm-seconds arms by "
                         "stopping and continuing them (SIGSTOP/SIGCONT): no process start-up in the arms, many "
                         "short pairs (not for 1000halfopen, whose load is the open connections)")
    ap.add_argument("--arm-seconds", type=float, default=0.5)
    ap.add_argument("--max-seconds", type=float, default=0.0,
                    help="start no new round of pairs past this many seconds (0: no limit); the table covers the rounds done")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--train-cpu", type=int, default=0)
    ap.add_argument("--scrape-cpu", type=int, default=1)
    ap.add_argument("--server-cpu", type=int, default=-1,
                    help="pin the server child (every thread: exporter_server_cpus) and the static control server to "
                         "this CPU (-1: they inherit the training process's affinity, the default behaviour)")
    ap.add_argument("--token", default="", help="bearer token the exporter requires (mfuwatch server)")
    ap.add_argument("--server-cpu-main-only", action="store_true",
                    help="with --server-cpu: move only the child's main thread from outside (what run 3 did, so its "
                         "loop thread stayed on the training CPU) instead of exporter_server_cpus")
    ap.add_argument("--scraper", nargs=4, metavar=("N", "MODE", "HOST", "PORT"), help=argparse.SUPPRESS)
    ap.add_argument("--static-server", type=int, metavar="NBYTES", help=argparse.SUPPRESS)
    ap.add_argument("--pool", nargs="+", metavar="JSON",
                    help="print the pair ratios of these result files pooled per configuration (median, IQR, 95%% "
                         "bootstrap interval of the median) and exit")
    args = ap.parse_args()
    if args.pool:
        return pool(args.pool)
    if args.static_server is not None:
        if args.server_cpu >= 0:
            pin(args.server_cpu)
        static_main(args.static_server)
        return 0
    if args.scraper:
        pin(args.scrape_cpu)
        n, mode, host, port = args.scraper
        scraper_main(int(n), mode, host, int(port), args.token)
        return 0

    t_start = time.monotonic()
    pin(args.train_cpu)
    from mfuwatch.agent import Agent

    step, tokens = make_step(args.device, args.batch, args.seq)
    cfg = dict(run="scrape-load", nvml=False, profile_every="off", alerts=False, flops_per_step=1e9, port=0,
               progress=False, exporter=args.server == "mfuwatch", exporter_server=args.mode)
    if args.server_cpu >= 0 and not args.server_cpu_main_only:
        cfg["exporter_server_cpus"] = [args.server_cpu % os.cpu_count()]
    if args.token:
        os.environ["MFUWATCH_BENCH_TOKEN"] = args.token
        cfg["exporter_auth"] = {"type": "bearer", "token_env": "MFUWATCH_BENCH_TOKEN"}
    agent = Agent(config=cfg)
    legacy = None
    if args.server == "mfuwatch":
        port = int(agent.exporter_url.rsplit(":", 1)[1].split("/")[0])
        mode_used = agent.exporter.mode
    else:
        from prometheus_client import start_http_server

        legacy = start_http_server(0, addr="127.0.0.1", registry=agent.exporter.exposed_registry)
        port = legacy[0].server_address[1]
        mode_used = "prometheus_client"
    srv = getattr(agent.exporter, "_server", None)
    child_pid = getattr(srv, "pid", None) if mode_used == "process" else None
    if child_pid is not None and args.server_cpu >= 0 and args.server_cpu_main_only:
        os.sched_setaffinity(child_pid, {args.server_cpu % os.cpu_count()})  # the main thread only
    static = None
    from prometheus_client import generate_latest

    if any(c in STATIC for c in args.configs.split(",")):
        static = subprocess.Popen([sys.executable, __file__, "--server-cpu", str(args.server_cpu), "--static-server",
                                   str(len(generate_latest(agent.exporter.exposed_registry)))], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        static_port = int(static.stdout.readline())
    placement = {f"child {tid}": v for tid, v in _task_cpus(child_pid).items()} if child_pid else {}
    if static is not None:
        placement.update({f"static {tid}": v for tid, v in _task_cpus(static.pid).items()})
    placement.update({f"training-process {tid}": v for tid, v in _task_cpus(os.getpid()).items()})
    print("CPU affinity (allowed, last ran on) per task:", placement, flush=True)
    probe = Probe(args.train_cpu, srv if mode_used == "process" else None,
                  {"child_cpu": child_pid, "static_cpu": static.pid if static is not None else None})
    for _ in range(50):  # warm-up
        step()
        agent.step(tokens=tokens)

    def block(seconds: float):
        """Steps for ``seconds``: (wall times, training-thread CPU times) per step."""
        walls, cpus = [], []
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            t0, c0 = time.perf_counter(), time.thread_time()
            step()
            agent.step(tokens=tokens)
            cpus.append(time.thread_time() - c0)
            walls.append(time.perf_counter() - t0)
        return walls, cpus

    def server_cpu() -> float:
        if static is not None and cur[0] in STATIC:
            return _proc_cpu(static.pid)
        if child_pid is not None:
            return _proc_cpu(child_pid)
        return srv.cpu_seconds if srv is not None and mode_used == "thread" else 0.0

    def scrapers(n: int, mode: str, to_port: int):
        proc = subprocess.Popen([sys.executable, __file__, "--scrape-cpu", str(args.scrape_cpu), "--token",
                                 args.token, "--scraper", str(n), mode, "127.0.0.1", str(to_port)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(0.5 if mode != "1hz" else 1.2)  # all scrapers in their steady state
        return proc

    def render_seconds() -> float:
        return float(getattr(srv, "render_seconds", 0.0)) if mode_used == "process" else 0.0

    def load_mark() -> tuple:
        """Counters at the start of a loaded arm: server CPU, render CPU, process CPU, wall time."""
        return server_cpu(), render_seconds(), time.process_time(), time.perf_counter()

    def record_load(a: dict, mark: tuple) -> None:
        """Append the loaded arm's shares (per wall second since ``mark``) and thread/descriptor counts to ``a``."""
        s0, r0, p0, w0 = mark
        dt = time.perf_counter() - w0
        a["server_share"].append((server_cpu() - s0) / dt)
        a["render_share"].append((render_seconds() - r0) / dt)
        a["train_share"].append((time.process_time() - p0) / dt)
        a["threads"].append(threading.active_count())
        a["fds"].append(_proc_fds("self"))
        if child_pid is not None:
            a["child_threads"].append(_proc_threads(child_pid))
            a["child_fds"].append(_proc_fds(child_pid))

    def toggled(name: str, a: dict, i: int) -> None:
        """One round of ``--toggle`` pairs for ``name``: the scrapers run in the load arms, stopped otherwise."""
        import signal

        n, mode = CONFIGS[name]
        proc = scrapers(n, mode, static_port if name in STATIC else port)
        os.kill(proc.pid, signal.SIGSTOP)
        for j in range(args.toggle):
            order = ("base", "load") if (i + j) % 2 == 0 else ("load", "base")
            meds = {}
            for kind in order:
                if kind == "load":
                    os.kill(proc.pid, signal.SIGCONT)
                    time.sleep(0.05)  # the requests pending at the stop are answered
                    mark = load_mark()
                p0 = probe.snap()
                w, c = block(args.arm_seconds)
                a["probe_" + kind].append(Probe.rates(p0, probe.snap()))
                meds[kind] = (statistics.median(w), statistics.median(c))
                if kind == "load":
                    record_load(a, mark)
                    os.kill(proc.pid, signal.SIGSTOP)
            a["ratios"].append(meds["load"][0] / meds["base"][0])
            a["cpu_ratios"].append(meds["load"][1] / meds["base"][1])
            a["base"].append(meds["base"][0])
            a["load"].append(meds["load"][0])
        os.kill(proc.pid, signal.SIGCONT)
        out, _ = proc.communicate(input="", timeout=60)
        a["stats"].append(json.loads(out.strip().splitlines()[-1]))
        print(f"round {i} {name}: {args.toggle} toggled pairs, median wall ratio "
              f"{statistics.median(a['ratios'][-args.toggle:]):.4f}", flush=True)

    names = [c for c in args.configs.split(",") if c]
    acc = {name: {"ratios": [], "cpu_ratios": [], "base": [], "load": [], "stats": [], "threads": [], "child_threads": [],
                  "fds": [], "child_fds": [], "server_share": [], "train_share": [], "render_share": [],
                  "probe_base": [], "probe_load": []}
           for name in names}
    rounds = 0
    cur = [None]
    for i in range(args.pairs):  # rounds: every configuration once per round (interleaved), ABBA within a pair
        if args.max_seconds and i and time.monotonic() - t_start > args.max_seconds:
            break
        rounds += 1
        for name in names[i % len(names):] + names[:i % len(names)]:  # each round starts one later: no fixed order
            n, mode = CONFIGS[name]
            a = acc[name]
            cur[0] = name
            if args.toggle and mode != "halfopen":
                toggled(name, a, i)
                continue
            order = ("base", "load") if i % 2 == 0 else ("load", "base")
            meds = {}
            for kind in order:
                if kind == "base":
                    p0 = probe.snap()
                    w, c = block(args.block_seconds)
                    a["probe_base"].append(Probe.rates(p0, probe.snap()))
                    meds[kind] = (statistics.median(w), statistics.median(c))
                    continue
                proc = scrapers(n, mode, static_port if name in STATIC else port)
                mark = load_mark()
                p0 = probe.snap()
                w, c = block(args.block_seconds)
                a["probe_load"].append(Probe.rates(p0, probe.snap()))
                meds[kind] = (statistics.median(w), statistics.median(c))
                record_load(a, mark)
                out, _ = proc.communicate(input="", timeout=60)
                a["stats"].append(json.loads(out.strip().splitlines()[-1]))
            a["ratios"].append(meds["load"][0] / meds["base"][0])
            a["cpu_ratios"].append(meds["load"][1] / meds["base"][1])
            a["base"].append(meds["base"][0])
            a["load"].append(meds["load"][0])
            print(f"round {i} {name}: wall ratio {a['ratios'][-1]:.4f} cpu ratio {a['cpu_ratios'][-1]:.4f}", flush=True)
    results = {}
    for name in names:
        a = acc[name]
        stats = a["stats"]
        ok = sum(s["ok"] for s in stats)
        med = (lambda xs: round(statistics.median(xs), 4) if xs else None)
        results[name] = {
            "cost": statistics.median(a["ratios"]) - 1.0, "ratios": [round(r, 4) for r in a["ratios"]],
            "cpu_cost": statistics.median(a["cpu_ratios"]) - 1.0, "cpu_ratios": [round(r, 4) for r in a["cpu_ratios"]],
            "base_step_ms": round(statistics.median(a["base"]) * 1e3, 3),
            "load_step_ms": round(statistics.median(a["load"]) * 1e3, 3),
            "scrapes_per_s": round(ok / (len(stats) * (args.toggle * (args.arm_seconds + 0.05) if args.toggle and
                                                       CONFIGS[name][1] != "halfopen" else args.block_seconds)), 1), "failed": sum(s["failed"] for s in stats),
            "p50_ms": round(statistics.median([s["p50_ms"] for s in stats if s["p50_ms"] is not None] or [0]), 2),
            "p99_ms": max([s["p99_ms"] for s in stats if s["p99_ms"] is not None] or [0]),
            "threads": max(a["threads"]), "child_threads": max(a["child_threads"]) if a["child_threads"] else None,
            "fds": max(a["fds"]), "child_fds": max(a["child_fds"]) if a["child_fds"] else None,
            "server_cpu_share": med(a["server_share"]), "train_process_cpu_share": med(a["train_share"]),
            "render_cpu_share": med(a["render_share"]), "pairs": len(a["ratios"]),
            "cost_ci95": [None if x is None else round(x - 1.0, 5) for x in _boot_ci(a["ratios"])],
            "cost_iqr": ([round(q - 1.0, 5) for q in statistics.quantiles(a["ratios"], n=4)]
                         if len(a["ratios"]) >= 4 else None),
            "probe_base": _median_rates(a["probe_base"]), "probe_load": _median_rates(a["probe_load"]),
        }
        print(f"{name}: {results[name]}", flush=True)
    if child_pid is not None:
        print("server child's tasks at the end (allowed, last ran on):", _task_cpus(child_pid), flush=True)
    agent.close()
    if static is not None:
        static.communicate(input="", timeout=10)
    if legacy is not None:
        legacy[0].shutdown()
    print(f"\nserver={args.server} mode={mode_used} device={args.device} pairs={rounds} block={args.block_seconds}s "
          f"(training pinned to CPU {args.train_cpu}, scrapers to CPU {args.scrape_cpu}; a server child inherits the "
          f"training process's CPU" + (f", here pinned to CPU {args.server_cpu})" if args.server_cpu >= 0 and child_pid
                                        else ")"))
    print("cost: median over pairs of (median step wall time with scrapers / without) - 1, [min..max of the pairs]; "
          "cpu cost: the same for the training thread's CPU time per step; IQR: the pairs' interquartile range; "
          "render CPU: the training process's CPU time rendering the exposition per wall second (process mode)")
    print(f"{'config':<14} {'step ms none->load':>20} {'cost':>8} {'pairs spread':>16} {'cpu cost':>9} "
          f"{'scrapes/s':>10} {'failed':>7} {'p50 ms':>8} {'p99 ms':>8} {'threads':>8} {'fds':>9} {'server CPU':>10} "
          f"{'train CPU':>10} {'pairs':>6} {'IQR':>16} {'render CPU':>10}")
    for k, r in results.items():
        thr = f"{r['threads']}" + (f"+{r['child_threads']}" if r["child_threads"] is not None else "")
        fds = f"{r['fds']}" + (f"+{r['child_fds']}" if r["child_fds"] is not None else "")
        sc = f"{r['server_cpu_share'] * 100:.2f}%" if r["server_cpu_share"] is not None else "n/a"
        tc = f"{r['train_process_cpu_share'] * 100:.1f}%" if r["train_process_cpu_share"] is not None else "n/a"
        print(f"{k:<14} {r['base_step_ms']:>9}->{r['load_step_ms']:<9} {r['cost'] * 100:>7.2f}% "
              f"{_spread(acc[k]['ratios']):>16} {r['cpu_cost'] * 100:>8.2f}% {r['scrapes_per_s']:>10} {r['failed']:>7} "
              f"{r['p50_ms']:>8} {r['p99_ms']:>8} {thr:>8} {fds:>9} {sc:>10} {tc:>10} {r['pairs']:>6} "
              f"{_iqr(acc[k]['ratios']):>16} "
              + (f"{r['render_cpu_share'] * 100:.3f}%" if r["render_cpu_share"] is not None else "n/a").rjust(10))
    print("\nwhere the time goes (medians over arms, per wall second, none -> load): training thread's run-queue "
          "wait (runnable, another task on its CPU) and CPU time, its voluntary/involuntary context switches, the "
          "training CPU's interrupts and NET_RX+NET_TX / TIMER / SCHED softirqs, the publisher's wake-ups, lines from "
          "the child and renders, the server's CPU (child or static control), the CPU time of the process's other "
          "threads")
    print(f"{'config':<14} {'train wait':>15} {'train run':>15} {'vol csw':>11} {'invol csw':>11} {'irq':>11} "
          f"{'net softirq':>12} {'timer':>11} {'sched':>11} {'wakeups':>9} {'lines':>9} {'renders':>9} "
          f"{'server CPU':>10}  other threads' CPU (load)")
    for k, r in results.items():
        b, lo = r["probe_base"], r["probe_load"]
        if not lo:
            continue

        def pair(key, fmt="{:.0f}", sub=None):
            x = (b.get(sub, {}) if sub else b).get(key, 0.0)
            y = (lo.get(sub, {}) if sub else lo).get(key, 0.0)
            return f"{fmt.format(x)}->{fmt.format(y)}"

        net = lambda d: d.get("softirq", {}).get("NET_RX", 0.0) + d.get("softirq", {}).get("NET_TX", 0.0)  # noqa: E731
        srv_key = "static_cpu" if k in STATIC else "child_cpu"
        others = ", ".join(f"{n} {v * 100:.2f}%" for n, v in sorted(lo.get("threads", {}).items()) if n != "training")
        print(f"{k:<14} {pair('wait', '{:.2%}'):>15} {pair('run', '{:.1%}'):>15} {pair('vcsw'):>11} {pair('ivcsw'):>11} "
              f"{pair('irq'):>11} {f'{net(b):.0f}->{net(lo):.0f}':>12} {pair('TIMER', sub='softirq'):>11} "
              f"{pair('SCHED', sub='softirq'):>11} {pair('wakeups', '{:.1f}'):>9} {pair('lines', '{:.1f}'):>9} "
              f"{pair('renders', '{:.1f}'):>9} {pair(srv_key, '{:.2%}'):>10}  {others}")
    print("\ncost with a 95% bootstrap interval of the median pair ratio:")
    for k, r in results.items():
        lo_, hi_ = r["cost_ci95"]
        ci = f"[{lo_ * 100:+.2f}..{hi_ * 100:+.2f}%]" if lo_ is not None else "n/a"
        print(f"  {k:<14} {r['cost'] * 100:+.2f}% {ci} ({r['pairs']} pairs)")
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    tag = (f"_cpu{args.server_cpu}" + ("main" if args.server_cpu_main_only else "")
           if args.server_cpu >= 0 and child_pid is not None else "")
    (out / f"scrape_load_{args.server}_{mode_used}{tag}_{args.device}.json").write_text(json.dumps(
        {"args": vars(args), "mode": mode_used, "pairs": rounds, "placement": {k: list(v) for k, v in placement.items()},
         "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
