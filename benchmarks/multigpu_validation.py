"""Multi-rank validation of the agent (issue 19): DDP / FSDP2 / FSDP2 + TP MFU, stragglers, hangs, goodput, overhead.

Launch with torchrun on one host; the backend is NCCL when CUDA is there, gloo otherwise:

    torchrun --nproc-per-node 4 benchmarks/multigpu_validation.py                 # 4 x H200, ~1 B Llama, bf16
    torchrun --nproc-per-node 2 benchmarks/multigpu_validation.py --tiny --parts mfu,straggler   # CPU, gloo

Parts (``--parts``, comma-separated; default all):

``mfu``        DDP, FSDP2 (``fully_shard``) and FSDP2 + tensor parallel 2 (when the world size is even and torch
               has ``torch.distributed.tensor.parallel``): per-rank agent MFU against truth = FlopCounterMode FLOPs
               of this rank's own forward + backward / wall time between two barriers / the peak the agent used;
               then one agent profiler window: its communication share and the ops it classed communication.
               Ranks get different batch sizes (``batch + rank``) so a per-rank count cannot pass by accident.
``straggler``  DDP; after a fast phase one rank sleeps 30% of the median step in its input pipeline. Per rank:
               the in-process straggler score, the goodput input-wait share and the step time; with Debian's
               ``prometheus`` on the PATH, a real Prometheus server scraping every rank through the agents'
               file_sd targets evaluates the fleet rules (short windows) and is asked for ``StragglerRank``
               (``kind="chronic"``, which synchronous DDP hides) and ``InputBoundRank`` (which names the rank).
``hang``       DDP; one rank stops (sleeps) just before the per-step loss ``all_reduce``. The hang watchdogs
               (short floor via config) report where each training thread waits; the rank not waiting in a
               collective is the one named.
``goodput``    a run with an ``agent.phase("eval")``, a ``torch.distributed.checkpoint`` save, a scripted input
               wait, then a restart (a new agent on the same timeline) that loads the checkpoint and re-does the
               steps run after it: goodput buckets against perf_counter times taken outside the agent.
``overhead``   paired, interleaved blocks of steps without and with the agent (order alternating per pair).

Each part prints a markdown table on rank 0 and writes it to ``$OUT/multigpu_<part>.md`` when OUT is set.
On the CPU the peak is a nominal 1e11 FLOP/s (MFU there is only a ratio check) and the model trains in fp32.
NVLink SHARP / multicast stay off: NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1
are set before torch.distributed starts.
"""

from __future__ import annotations

import os

os.environ.update({"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"})
# the NCCL flight recorder: the hang watchdog reads the last collective from it (NCCL collectives return at once,
# so a waiting rank's Python stack is at the next host sync, not inside the collective)
if "TORCH_FR_BUFFER_SIZE" not in os.environ:  # torch >= 2.13's name; torch 2.11 reads the older one
    os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")

import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import urllib.parse  # noqa: E402
import urllib.request  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable, Dict, List, Optional  # noqa: E402

# this folder holds a kernels.py that would shadow the `kernels` package transformers looks for
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402,F401  (imported before any agent: its save/load get hooked)
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from mfuwatch.agent import Agent  # noqa: E402
from mfuwatch.agent.distributed import end_process_group  # noqa: E402
from mfuwatch.agent.flops import op_flops  # noqa: E402
from mfuwatch.agent.live.timeline import read_timeline  # noqa: E402

CPU_PEAK = 1e11  # nominal FLOP/s on the CPU: MFU there is only compared with the truth, never read as a figure
PARTS = ("mfu", "straggler", "hang", "goodput", "overhead")


# ----------------------------------------------------------------------------------------------- set-up
class Ctx:
    """What every part needs: rank, world, device, dtype, shapes, the work folder (shared by the ranks)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.cuda = torch.cuda.is_available() and not args.cpu
        self.device = torch.device("cuda", self.local_rank) if self.cuda else torch.device("cpu")
        self.dtype = torch.bfloat16 if self.cuda else torch.float32
        self.peak = None if self.cuda else CPU_PEAK  # GPU: the agent's own peak (datasheet table)
        self.tiny = args.tiny or not self.cuda
        self.s = (dict(hidden=64, heads=4, kv=2, ff=128, layers=2, vocab=256, seq=64, batch=2) if self.tiny else
                  dict(hidden=2048, heads=16, kv=8, ff=5632, layers=16, vocab=32000, seq=2048, batch=4))
        work = [args.work or tempfile.mkdtemp(prefix="mfuwatch-multi-")] if self.rank == 0 else [None]
        dist.broadcast_object_list(work, src=0)
        self.work = Path(work[0])

    def agent_cfg(self, name: str, **kw: Any) -> Dict[str, Any]:
        cfg: Dict[str, Any] = dict(exporter=False, alerts=False, profile_every="off", run=f"multi-{name}",
                                   report_every_steps=5, nvml=self.cuda)
        if self.peak is not None:
            cfg["peak_flops"] = self.peak
        cfg.update(kw)
        return cfg

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        dist.barrier()


def build_llama(ctx: Ctx, attn: str = "sdpa") -> torch.nn.Module:
    """A Hugging Face Llama from a config (no download), the same weights on every rank (seed 0)."""
    import transformers

    s = ctx.s
    cfg = transformers.LlamaConfig(vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["ff"],
                                   num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                                   num_key_value_heads=s["kv"], max_position_embeddings=s["seq"])
    torch.manual_seed(0)
    with torch.device(ctx.device):
        model = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation=attn)
    return model.to(ctx.dtype)


def batch(ctx: Ctx, b: int, seed: int = 0, data_rank: Optional[int] = None) -> Dict[str, torch.Tensor]:
    """Token ids (b, seq) for this rank (``data_rank``: the ranks of one TP group must get the same batch)."""
    g = torch.Generator().manual_seed(1000 * (ctx.rank if data_rank is None else data_rank) + seed)
    ids = torch.randint(0, ctx.s["vocab"], (b, ctx.s["seq"]), generator=g).to(ctx.device)
    return {"input_ids": ids, "labels": ids}


def wrap(ctx: Ctx, model: torch.nn.Module, scheme: str) -> torch.nn.Module:
    """``ddp``, ``fsdp`` (FSDP2 ``fully_shard`` per decoder layer and the root) or ``fsdp_tp`` (TP 2 inside)."""
    if scheme == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model, device_ids=[ctx.local_rank] if ctx.cuda else None)
    from torch.distributed.fsdp import fully_shard

    if scheme == "fsdp":
        for layer in model.model.layers:
            fully_shard(layer)
        return fully_shard(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh(ctx.device.type, (ctx.world // 2, 2), mesh_dim_names=("dp", "tp"))
    plan = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()}
    for layer in model.model.layers:
        parallelize_module(layer, mesh["tp"], plan)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    return fully_shard(model, mesh=mesh["dp"])


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, inputs: Dict[str, torch.Tensor]) -> torch.Tensor:
    loss = model(**inputs).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


TP_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # the TP plan of wrap()


def truth_flops(model: torch.nn.Module, inputs: Dict[str, torch.Tensor], tp: int = 1) -> int:
    """FlopCounterMode FLOPs of one forward + backward of this rank's model on its own batch (no optimizer).

    With tensor parallelism FlopCounterMode sees the DTensor matmuls of the sharded projections at their global
    shapes (it dispatches before DTensor splits them) and the attention on the local heads; a rank computes 1/tp
    of each sharded projection (even Colwise/Rowwise shards), so those modules' counts are divided by ``tp``.
    """
    with FlopCounterMode(display=False, custom_mapping=op_flops.flop_counter_mapping()) as fc:
        model(**inputs).loss.backward()
    model.zero_grad(set_to_none=True)
    total = int(fc.get_total_flops())
    if tp > 1:  # each sharded projection: 2 (forward) + 2 (input grad) + 2 (weight grad) FLOPs per weight and token
        tokens = int(inputs["input_ids"].numel())
        sharded = sum(6 * tokens * m.in_features * m.out_features for name, m in model.named_modules()
                      if name.split(".")[-1] in TP_LINEARS and isinstance(m, torch.nn.Linear))
        total -= sharded - sharded // tp
    return total


def gather(obj: Any) -> List[Any]:
    out: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def fmt(v: Any) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def table(rows: List[Dict[str, Any]], cols: List[str]) -> str:
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def emit(ctx: Ctx, part: str, text: str, data: Any) -> None:
    """Print a part's table on rank 0 and write it (and its numbers) under $OUT."""
    if ctx.rank != 0:
        return
    dev = torch.cuda.get_device_name(ctx.device) if ctx.cuda else "CPU"
    head = (f"## {part} ({ctx.world} ranks, {dist.get_backend()}, {dev}, torch {torch.__version__}, "
            f"{'tiny' if ctx.tiny else '~1B'} Llama)\n\n")
    print(head + text + "\n", flush=True)
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"multigpu_{part}.md").write_text(head + text + "\n")
        (Path(out) / f"multigpu_{part}.json").write_text(json.dumps(data, indent=2, default=str))


def timeline_mfu(path: Path, after_step: int, upto_step: int, peak: float) -> Optional[float]:
    """Agent MFU over the step records of steps ``after_step + 1 .. upto_step``: sum of model FLOPs / sum of step
    time / peak (records reaching into the profiler window are left out: profiling slows its steps)."""
    recs = [r for r in read_timeline(path) if r.get("kind") == "step" and r["step"] - r["steps"] >= after_step
            and r["step"] <= upto_step]
    flops = sum(r["model_flops"] * r["steps"] for r in recs)
    secs = sum(r["step_time_seconds"] * r["steps"] for r in recs)
    return flops / secs / peak if secs > 0 and peak else None


# ----------------------------------------------------------------------------------------------- part 1: MFU
def part_mfu(ctx: Ctx) -> bool:
    schemes = ["ddp", "fsdp"]
    if ctx.world % 2 == 0 and ctx.world >= 2:
        schemes.append("fsdp_tp")
    rows: List[Dict[str, Any]] = []
    ok = True
    warm, n = (3, 10) if ctx.tiny else (3, 20)
    for scheme in schemes:
        data_rank = ctx.rank // 2 if scheme == "fsdp_tp" else ctx.rank  # TP peers share a batch
        b = ctx.s["batch"] + data_rank
        inputs = batch(ctx, b, data_rank=data_rank)
        row: Dict[str, Any] = {"scheme": scheme, "rank": ctx.rank, "batch": f"{b}x{ctx.s['seq']}"}
        try:
            ref = wrap(ctx, build_llama(ctx, "eager"), scheme)  # truth: eager attention, plain matmuls
            row["truth_flops"] = truth_flops(ref, inputs, tp=2 if scheme == "fsdp_tp" else 1)
            del ref
            model = wrap(ctx, build_llama(ctx), scheme)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
            tl = ctx.work / f"mfu-{scheme}.rank{ctx.rank}.jsonl"
            tl.unlink(missing_ok=True)
            every = warm + n  # one window right after the timed steps
            agent = Agent(model, opt, config=ctx.agent_cfg(scheme, timeline=str(tl), profile_every=f"{every} steps",
                                                           profile_warmup_steps=1, profile_active_steps=2))
            try:
                for _ in range(warm):
                    train_step(model, opt, inputs)
                ctx.sync()
                t0 = time.perf_counter()
                for _ in range(n):
                    train_step(model, opt, inputs)
                ctx.sync()
                wall = (time.perf_counter() - t0) / n
                for _ in range(4):  # the profiler window (warm-up 1 + active 2) after step `every`
                    train_step(model, opt, inputs)
                ctx.sync()
                deadline = time.monotonic() + 60
                while agent.latest_window is None and time.monotonic() < deadline:
                    time.sleep(0.2)  # the window is analysed in a child process
            finally:
                agent.close()
            peak = agent.run_info.peak_flops_per_second or ctx.peak
            m = agent.latest
            row.update(flops_source=agent.run_info.flops_source, agent_flops=m.model_flops if m else None,
                       step_ms=wall * 1e3)
            row["flops_ratio"] = row["agent_flops"] / row["truth_flops"] if row["agent_flops"] else None
            row["truth_mfu"] = row["truth_flops"] / wall / peak if peak else None
            row["agent_mfu"] = timeline_mfu(tl, warm, warm + n, peak)
            row["mfu_ratio"] = (row["agent_mfu"] / row["truth_mfu"]) if row["agent_mfu"] and row["truth_mfu"] else None
            w = agent.latest_window
            if w is not None:
                row["comm_share"] = w.breakdown.get("communication", 0.0)
                row["comm_ops"] = ", ".join(sorted({o.op for o in w.top_ops if o.bound == "communication"})) or "-"
            del model, opt
        except Exception as exc:  # noqa: BLE001 - a scheme the backend or torch does not support: say so
            print(f"[rank {ctx.rank}] {scheme}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            row["error"] = f"{type(exc).__name__}: {str(exc)[:120]}"
        rows.append(row)
    allrows = [r for rank_rows in gather(rows) for r in rank_rows]
    allrows.sort(key=lambda r: (schemes.index(r["scheme"]), r["rank"]))
    for r in allrows:
        ok &= r.get("flops_ratio") is not None and abs(r["flops_ratio"] - 1) <= 0.02
    cols = ["scheme", "rank", "batch", "flops_source", "agent_flops", "truth_flops", "flops_ratio", "agent_mfu",
            "truth_mfu", "mfu_ratio", "step_ms", "comm_share", "comm_ops", "error"]
    emit(ctx, "mfu", table(allrows, cols) + f"\n\nFLOPs within 2% of truth on every rank: {'yes' if ok else 'NO'}",
         allrows)
    return ok


# ----------------------------------------------------------------------------------------------- prometheus helpers
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prom_query(base: str, expr: str) -> list:
    url = base + "/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    body = json.loads(urllib.request.urlopen(url, timeout=5).read().decode())
    return body["data"]["result"] if body.get("status") == "success" else []


class Prometheus:
    """A Prometheus server (Debian's ``prometheus``) on 127.0.0.1 scraping the file_sd targets every second and
    evaluating the fleet rules rendered with short windows."""

    def __init__(self, binary: str, sd_dir: Path, work: Path, window: float, straggler_for: float) -> None:
        import yaml

        from mfuwatch.alerts.fleet_rules import render_fleet

        work.mkdir(parents=True, exist_ok=True)
        (work / "fleet.rules.yml").write_text(render_fleet(
            window_seconds=window, goodput_window_seconds=window, straggler_for_seconds=straggler_for,
            stalled_seconds=30.0, goodput_threshold=0.5, goodput_for_seconds=60.0, input_wait_for_seconds=straggler_for))
        (work / "prometheus.yml").write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "scrape_timeout": "900ms", "evaluation_interval": "1s"},
            "rule_files": [str(work / "fleet.rules.yml")],
            "scrape_configs": [{"job_name": "mfuwatch", "honor_labels": True,
                                "file_sd_configs": [{"files": [str(sd_dir / "*.json")], "refresh_interval": "1s"}]}]}))
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = open(work / "prometheus.log", "w")
        self.proc = subprocess.Popen([binary, f"--config.file={work / 'prometheus.yml'}",
                                      f"--storage.tsdb.path={work / 'tsdb'}",
                                      f"--web.listen-address=127.0.0.1:{self.port}"],
                                     stdout=self.log, stderr=subprocess.STDOUT)

    def query(self, expr: str) -> list:
        try:
            return prom_query(self.base, expr)
        except OSError:
            return []

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


# ----------------------------------------------------------------------------------------------- part 2: straggler
def part_straggler(ctx: Ctx) -> bool:
    slow_rank = ctx.world - 1
    model = wrap(ctx, build_llama(ctx), "ddp")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    inputs = batch(ctx, ctx.s["batch"] * (4 if ctx.tiny else 1))
    prom_bin = shutil.which("prometheus") if not ctx.args.no_prometheus else None
    sd = ctx.work / "straggler-sd"
    sd.mkdir(parents=True, exist_ok=True)
    job = f"multi-straggler-{int(time.time())}"
    cfg = ctx.agent_cfg("straggler", exporter=bool(prom_bin), port=0, file_sd_dir=str(sd) if prom_bin else None,
                        job=job, report_every_steps=2)
    agent = Agent(model, opt, config=cfg)
    prom = None
    if prom_bin and ctx.rank == 0:
        prom = Prometheus(prom_bin, sd, ctx.work / "straggler-prom", window=10.0, straggler_for=5.0)
    fast_steps = ctx.args.straggler_fast_steps
    slow_seconds = ctx.args.straggler_slow_seconds
    times: List[float] = []
    firing: Dict[str, Any] = {}
    try:
        for _ in range(fast_steps):
            t = time.perf_counter()
            train_step(model, opt, inputs)
            times.append(time.perf_counter() - t)
        med = statistics.median(gather(statistics.median(times[2:])))  # the same figure on every rank
        delay = 0.3 * med
        score_fast = agent.fleet.straggler.score() if agent.fleet else None
        gp0 = agent.fleet.goodput.snapshot() if agent.fleet else {}
        ctx.sync()
        stop = threading.Event()
        watcher = None
        if prom is not None:  # rank 0 asks Prometheus while the job runs (its windows need live counters)
            watcher = threading.Thread(target=watch_prometheus, args=(prom, job, slow_seconds, stop, firing),
                                       daemon=True)
            watcher.start()
        t0, steps, slow_times = time.perf_counter(), 0, []
        while True:
            t = time.perf_counter()
            if ctx.rank == slow_rank:
                time.sleep(delay)  # the slowed rank's input pipeline
            train_step(model, opt, inputs)
            slow_times.append(time.perf_counter() - t)
            steps += 1
            if steps % 5 == 0:  # every rank stops at the same step: agree on it with a MAX reduction
                flag = torch.tensor([1.0 if time.perf_counter() - t0 > slow_seconds else 0.0], device=ctx.device)
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                if flag.item() > 0:
                    break
        stop.set()
        time.sleep(1.0)  # the agent thread reports the last steps
        score_slow = agent.fleet.straggler.score() if agent.fleet else None
        gp1 = agent.fleet.goodput.snapshot() if agent.fleet else {}
        d = {k: gp1.get(k, 0.0) - gp0.get(k, 0.0) for k in gp1}
        row = {"rank": ctx.rank, "slowed": ctx.rank == slow_rank, "sleep_ms": delay * 1e3 if ctx.rank == slow_rank else 0.0,
               "step_ms_fast": 1e3 * statistics.median(times[2:]),
               "step_ms_slow": 1e3 * statistics.median(slow_times), "score_fast": score_fast, "score_slow": score_slow,
               "input_wait_share": d.get("input_wait", 0.0) / max(1e-9, sum(d.values())), "steps_slow": steps}
        stop.set()
        if watcher is not None:
            watcher.join(10)
    finally:
        agent.close()
        if prom is not None:
            prom.stop()
    rows = gather(row)
    scores = {r["rank"]: r["score_slow"] for r in rows}
    lowest = min((r for r in rows if r["score_slow"] is not None), key=lambda r: r["score_slow"], default=None)
    most_wait = max(rows, key=lambda r: r["input_wait_share"])
    cols = ["rank", "slowed", "sleep_ms", "step_ms_fast", "step_ms_slow", "score_fast", "score_slow",
            "input_wait_share", "steps_slow"]
    text = table(rows, cols)
    text += (f"\n\nIn-process straggler score, lowest: rank {lowest['rank'] if lowest else 'n/a'} "
             f"(slowed: rank {slow_rank}; scores {', '.join(f'{k}: {fmt(v)}' for k, v in scores.items())}). "
             f"Largest input-wait share: rank {most_wait['rank']}.")
    if ctx.rank == 0:
        if prom_bin:
            alerted = firing.get("alerted", [])
            text += (f"\n\nPrometheus ({firing.get('targets')} targets up; 10 s windows, for 5 s): StragglerRank "
                     f"(kind=chronic) firing for ranks {alerted or 'none'}; InputBoundRank firing for ranks "
                     f"{firing.get('input_bound') or 'none'}; rank:mfuwatch_step_time_vs_fastest:ratio "
                     f"{ {k: round(v, 3) for k, v in firing['ratio_by_rank'].items()} }; input-wait share over 10 s "
                     f"{ {k: round(v, 3) for k, v in firing['input_wait_by_rank'].items()} }.")
        else:
            text += "\n\nPrometheus: not run (no `prometheus` on the PATH, or --no-prometheus)."
    emit(ctx, "straggler", text, {"rows": rows, "prometheus": firing})
    named_by_score = bool(lowest) and lowest["rank"] == slow_rank and lowest["score_slow"] < min(
        r["score_slow"] for r in rows if r["rank"] != slow_rank) - 0.05
    if ctx.rank == 0:
        print(f"straggler named by the in-process score: {'yes' if named_by_score else 'NO'}; by the input-wait "
              f"share: {'yes' if most_wait['rank'] == slow_rank else 'NO'}", flush=True)
    return most_wait["rank"] == slow_rank


def watch_prometheus(prom: Prometheus, job: str, seconds: float, stop: threading.Event, out: Dict[str, Any]) -> None:
    """Rank 0's thread: from 15 s into the slow phase (10 s window + 5 s ``for``) until ``stop``, keep the latest
    firing ``StragglerRank{kind="chronic"}`` and ``InputBoundRank`` ranks, the recorded step-time ratios and the
    input-wait shares per rank."""
    t0 = time.monotonic()
    out.update(alerted=[], input_bound=[], ratio_by_rank={}, input_wait_by_rank={}, targets=0)
    while not stop.wait(1.0):
        if time.monotonic() - t0 < min(15.0, 0.6 * seconds):
            continue
        out["targets"] = sum(1 for r in prom.query('up{job="mfuwatch"}') if r["value"][1] == "1")
        alerted = sorted(a["metric"].get("rank") for a in prom.query(
            f'ALERTS{{alertname="StragglerRank",kind="chronic",alertstate="firing",job="{job}"}}'))
        out["alerted"] = sorted(set(out["alerted"]) | set(alerted))
        bound = sorted(a["metric"].get("rank") for a in prom.query(
            f'ALERTS{{alertname="InputBoundRank",alertstate="firing",job="{job}"}}'))
        out["input_bound"] = sorted(set(out["input_bound"]) | set(bound))
        ratio = {r["metric"].get("rank"): float(r["value"][1]) for r in prom.query(
            f'rank:mfuwatch_step_time_vs_fastest:ratio{{job="{job}"}}')}
        wait = {r["metric"].get("rank"): float(r["value"][1]) for r in prom.query(
            f'sum by (rank) (rate(mfuwatch_goodput_seconds_total{{job="{job}",bucket="input_wait"}}[10s])) / '
            f'sum by (rank) (rate(mfuwatch_goodput_seconds_total{{job="{job}"}}[10s]))')}
        if ratio:
            out["ratio_by_rank"] = ratio
        if wait:
            out["input_wait_by_rank"] = wait


# ----------------------------------------------------------------------------------------------- part 3: hang
def part_hang(ctx: Ctx) -> bool:
    hang_rank = ctx.world - 1
    model = wrap(ctx, build_llama(ctx), "ddp")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    inputs = batch(ctx, ctx.s["batch"])
    tl = ctx.work / f"hang.rank{ctx.rank}.jsonl"
    tl.unlink(missing_ok=True)
    floor = ctx.args.hang_floor
    agent = Agent(model, opt, config=ctx.agent_cfg("hang", timeline=str(tl), hang_floor_seconds=floor, hang_factor=3.0))
    steps_at_hang = None
    try:
        for i in range(12):
            loss = train_step(model, opt, inputs)
            if i == 9 and ctx.rank == hang_rank:
                steps_at_hang = agent.hooks.step
                time.sleep(floor * 2.5 + 2)  # stops before the collective below; the others wait in it
            dist.all_reduce(loss)  # the loss averaged for logging: a collective outside the model
            if ctx.cuda:
                loss.item()  # the logging sync (host-device): where a NCCL rank waits for the collective
            if i == 9:
                steps_at_hang = agent.hooks.step
        ctx.sync()
    finally:
        agent.close()
    hangs = [r for r in read_timeline(tl) if r.get("kind") == "hang"]
    h = hangs[0] if hangs else None
    in_coll = bool(h) and (any("distributed_c10d" in f and ("all_reduce" in f or "wrapper" in f) for f in h["stack"][-3:])
                           or bool(h.get("last_collective")) and "completed" not in h["last_collective"])
    row = {"rank": ctx.rank, "stopped": ctx.rank == hang_rank, "steps_done": steps_at_hang,
           "hang_reports": len(hangs), "elapsed_s": h["elapsed_seconds"] if h else None,
           "threshold_s": h["threshold_seconds"] if h else None, "waits_in_collective": in_coll,
           "where": (h["where"].split("/")[-1] if h else None), "last_collective": h.get("last_collective") if h else None,
           "resolved": any(
               r.get("kind") == "hang_resolved" for r in read_timeline(tl))}
    rows = gather(row)
    named = [r["rank"] for r in rows if r["hang_reports"] and not r["waits_in_collective"]]
    ok = named == [hang_rank] and all(r["waits_in_collective"] for r in rows if r["rank"] != hang_rank)
    text = table(rows, ["rank", "stopped", "steps_done", "hang_reports", "elapsed_s", "threshold_s",
                        "waits_in_collective", "where", "last_collective", "resolved"])
    text += (f"\n\nThe rank whose watchdog report is not inside a collective: {named or 'none'} (stopped: {hang_rank}). "
             f"Steps done at the hang, per rank: {[r['steps_done'] for r in rows]} (a synchronous job keeps every rank "
             "at the same step, so `steps behind the leader` is 0 everywhere).")
    emit(ctx, "hang", text, rows)
    return ok


# ----------------------------------------------------------------------------------------------- part 4: goodput
def part_goodput(ctx: Ctx) -> bool:
    model = wrap(ctx, build_llama(ctx), "ddp")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    inputs = batch(ctx, ctx.s["batch"])
    tl = ctx.work / f"goodput.rank{ctx.rank}.jsonl"
    tl.unlink(missing_ok=True)
    ckpt = ctx.work / "goodput-ckpt"
    wait_s = ctx.args.input_wait
    meas = {"input_wait": 0.0, "eval": 0.0, "checkpoint_save": 0.0, "checkpoint_load": 0.0}

    def steps(agent_steps: int) -> None:
        for _ in range(agent_steps):
            t = time.perf_counter()
            time.sleep(wait_s)  # a scripted input wait
            meas["input_wait"] += time.perf_counter() - t
            train_step(model, opt, inputs)

    def state() -> Dict[str, Any]:
        return {"model": model.module.state_dict()}

    cfg = ctx.agent_cfg("goodput", timeline=str(tl), goodput_warmup_steps=2)
    t_start = time.perf_counter()
    agent = Agent(model, opt, config=cfg)
    steps(8)
    t = time.perf_counter()
    with agent.phase("eval"):
        with torch.no_grad():
            model.eval()
            for _ in range(4):
                model(**inputs)
            model.train()
    meas["eval"] += time.perf_counter() - t
    dist.barrier()
    t = time.perf_counter()
    dcp.save(state(), checkpoint_id=str(ckpt))  # hooked by the agent: checkpoint_save
    meas["checkpoint_save"] += time.perf_counter() - t
    steps(4)  # lost when the job "crashes" here
    agent.close()
    a1 = dict(agent.fleet.goodput.snapshot())
    wall1 = time.perf_counter() - t_start
    # restart: a new agent on the same timeline, the checkpoint loaded, the 4 lost steps re-done
    model = wrap(ctx, build_llama(ctx), "ddp")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    t_start2 = time.perf_counter()
    agent2 = Agent(model, opt, config=cfg)
    sd = state()
    t = time.perf_counter()
    dcp.load(sd, checkpoint_id=str(ckpt))  # hooked: checkpoint_load
    meas["checkpoint_load"] += time.perf_counter() - t
    model.module.load_state_dict(sd["model"])
    steps(8)
    agent2.close()
    a2 = dict(agent2.fleet.goodput.snapshot())
    wall2 = time.perf_counter() - t_start2
    redo = agent2.fleet.resume.get("steps")
    agent_sum = {k: a1.get(k, 0.0) + a2.get(k, 0.0) for k in a1}
    row = {"rank": ctx.rank, "agent": agent_sum, "measured": meas, "wall": wall1 + wall2, "redo_steps": redo,
           "lost_progress_s": a2.get("lost_progress", 0.0)}
    rows = gather(row)
    lines = ["| bucket | " + " | ".join(f"rank {r['rank']} agent (s) | rank {r['rank']} measured (s)" for r in rows) + " |",
             "|---|" + "---|---|" * len(rows)]
    for b in ("productive", "input_wait", "warmup", "eval", "checkpoint_save", "checkpoint_load", "lost_progress",
              "startup", "other"):
        lines.append(f"| {b} | " + " | ".join(f"{r['agent'].get(b, 0.0):.3f} | "
                                              f"{fmt(r['measured'].get(b)) if b in r['measured'] else ''}"
                                              for r in rows) + " |")
    lines.append("| sum of buckets / wall | " + " | ".join(
        f"{sum(r['agent'].values()):.3f} | {r['wall']:.3f}" for r in rows) + " |")
    text = "\n".join(lines)
    text += ("\n\nSteps to re-do after the restart, from the timeline: "
             f"{[r['redo_steps'] for r in rows]} (4 ran after the checkpoint). Measured = perf_counter around the "
             f"scripted {wait_s * 1e3:.0f} ms input sleeps, the eval block, dcp.save and dcp.load, outside the agent.")
    ok = True
    for r in rows:
        for b in ("eval", "checkpoint_save", "checkpoint_load"):
            ok &= abs(r["agent"].get(b, 0.0) - r["measured"][b]) <= 0.05 * r["measured"][b] + 0.005
        ok &= r["agent"].get("input_wait", 0.0) >= 0.9 * r["measured"]["input_wait"]
        ok &= r["redo_steps"] == 4
    emit(ctx, "goodput", text, rows)
    return ok


# ----------------------------------------------------------------------------------------------- part 5: overhead
def part_overhead(ctx: Ctx) -> bool:
    model = wrap(ctx, build_llama(ctx), "ddp")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    inputs = batch(ctx, ctx.s["batch"])
    pairs, block = ctx.args.pairs, ctx.args.block
    for _ in range(3):
        train_step(model, opt, inputs)

    def run_block(with_agent: bool) -> float:
        agent = Agent(model, opt, config=ctx.agent_cfg("overhead")) if with_agent else None
        try:
            for _ in range(3):  # untimed: the agent's first steps (clock start, the FlopCounterMode step under DDP)
                train_step(model, opt, inputs)
            ctx.sync()
            t = time.perf_counter()
            for _ in range(block):
                train_step(model, opt, inputs)
            ctx.sync()
            return (time.perf_counter() - t) / block
        finally:
            if agent is not None:
                agent.close()

    diffs, without, with_ = [], [], []
    for p in range(pairs):
        order = (False, True) if p % 2 == 0 else (True, False)
        got = {w: run_block(w) for w in order}
        without.append(got[False])
        with_.append(got[True])
        diffs.append(got[True] / got[False] - 1)
    q = statistics.quantiles(diffs, n=4) if len(diffs) >= 2 else [diffs[0]] * 3
    row = {"rank": ctx.rank, "without_ms": 1e3 * statistics.median(without), "with_ms": 1e3 * statistics.median(with_),
           "overhead": f"{100 * statistics.median(diffs):+.2f}%", "iqr": f"{100 * q[0]:+.2f}% .. {100 * q[2]:+.2f}%",
           "pairs": pairs, "steps_per_block": block}
    rows = gather(row)
    emit(ctx, "overhead", table(rows, ["rank", "without_ms", "with_ms", "overhead", "iqr", "pairs", "steps_per_block"]),
         rows)
    return True


RUNNERS: Dict[str, Callable[[Ctx], bool]] = {"mfu": part_mfu, "straggler": part_straggler, "hang": part_hang,
                                             "goodput": part_goodput, "overhead": part_overhead}


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of: {', '.join(PARTS)}")
    ap.add_argument("--tiny", action="store_true", help="a CPU-sized Llama (always on without CUDA)")
    ap.add_argument("--cpu", action="store_true", help="run on the CPU with gloo even when CUDA is there")
    ap.add_argument("--work", default=None, help="folder for timelines and checkpoints (default: a temp folder)")
    ap.add_argument("--straggler-fast-steps", type=int, default=30)
    ap.add_argument("--straggler-slow-seconds", type=float, default=25.0)
    ap.add_argument("--no-prometheus", action="store_true", help="skip the Prometheus half of the straggler part")
    ap.add_argument("--hang-floor", type=float, default=2.0, help="hang_floor_seconds for the hang part")
    ap.add_argument("--input-wait", type=float, default=0.01, help="scripted input wait per step, seconds (goodput)")
    ap.add_argument("--pairs", type=int, default=6, help="overhead: pairs of blocks")
    ap.add_argument("--block", type=int, default=20, help="overhead: steps per block")
    args = ap.parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    bad = [p for p in parts if p not in RUNNERS]
    if bad:
        ap.error(f"--parts: unknown {bad}; accepted: {', '.join(PARTS)}")
    if "RANK" not in os.environ:
        ap.error("launch with torchrun --nproc-per-node N")
    cuda = torch.cuda.is_available() and not args.cpu
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    dist.init_process_group("nccl" if cuda else "gloo")
    ctx = Ctx(args)
    results = {}
    try:
        for p in parts:
            t = time.perf_counter()
            results[p] = RUNNERS[p](ctx)
            if ctx.rank == 0:
                print(f"[{p}: {'PASS' if results[p] else 'FAIL'} in {time.perf_counter() - t:.1f} s]\n", flush=True)
    finally:
        del ctx
        end_process_group()
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
