"""One simulated rank for the fleet scale test: a step loop with controlled step times and the real exporter.

Runs the agent's own metric path without torch (32 processes must fit a 2-core CI machine): the
:class:`~mfuwatch.agent.live.exporter.Exporter` with its `job`-labelled view, the
:class:`~mfuwatch.agent.fleet.accounting.FleetAccounting` (FLOP and step-time counters, goodput, hang watchdog,
straggler score) and the agent's file-SD target file, fed exactly as ``Agent`` feeds them: a forward
start and a boundary per step on this (the "training") thread, intervals and report measurements after.

Each step sleeps until its deadline (``step_seconds`` apart, so jitter does not accumulate), after an
input wait of ``input_wait_ratio`` of the step. Signals change the loop: SIGUSR1 makes the steps 30%
slower (a straggler), SIGUSR2 stops stepping inside :func:`stuck_in_data_loader` while the exporter keeps
serving (a hang), SIGWINCH makes half of each step's period an input wait at the same period (a slow data
loader whose step time is unchanged, as in synchronous data parallel, where the other ranks' steps absorb
it), SIGALRM runs one ``eval`` phase of ``--eval-seconds`` (``fleet.enter``/``exit``, as ``agent.phase`` does)
and then steps on, SIGHUP opens an ``eval`` phase that never ends (inside :func:`stuck_in_eval`). Usage::

    python -m tests.helpers.fleet_rank --rank 3 --world 32 --run R --job J --sd-dir DIR --step-seconds 0.1
"""

from __future__ import annotations

import argparse
import signal
import time

from mfuwatch.agent.config import load_config
from mfuwatch.agent.errors import ErrorCounter
from mfuwatch.agent.live.exporter import Exporter
from mfuwatch.agent.fleet.accounting import FleetAccounting, FleetSettings
from mfuwatch.agent.fleet.job import job_labelled_view, resolve_job
from mfuwatch.agent.schema import RunInfo, StepMeasurement
from mfuwatch.agent.live.timeline import Timeline

try:  # the layout engineer moves it to agent/distributed.py
    from mfuwatch.agent.distributed import FileSDTarget  # type: ignore
except ImportError:  # pragma: no cover - before the move
    from mfuwatch.agent.integrations.distributed import FileSDTarget

SLOWDOWN = 1.3
INPUT_BOUND_WAIT = 0.5  # share of the step period spent waiting for input after SIGWINCH
state = {"slow": False, "hang": False, "input_bound": False, "eval_once": False, "eval_forever": False}


def stuck_in_data_loader() -> None:
    """Where the hung rank waits (the hang watchdog must name this frame)."""
    while True:
        time.sleep(3600)


def stuck_in_eval(fleet: FleetAccounting) -> None:
    """A phase that never ends (the stall rules must not page for it)."""
    fleet.enter("eval")
    while True:
        time.sleep(3600)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--run", required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--sd-dir", required=True)
    p.add_argument("--step-seconds", type=float, default=0.1)
    p.add_argument("--input-wait-ratio", type=float, default=0.1)
    p.add_argument("--flops-per-step", type=float, default=2e10)
    p.add_argument("--peak", type=float, default=1e12)
    p.add_argument("--tokens-per-step", type=int, default=4096)
    p.add_argument("--report-every", type=int, default=10)
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--eval-seconds", type=float, default=8.0)
    a = p.parse_args()
    signal.signal(signal.SIGUSR1, lambda *_: state.update(slow=True))
    signal.signal(signal.SIGUSR2, lambda *_: state.update(hang=True))
    signal.signal(signal.SIGWINCH, lambda *_: state.update(input_bound=True))
    signal.signal(signal.SIGALRM, lambda *_: state.update(eval_once=True))
    signal.signal(signal.SIGHUP, lambda *_: state.update(eval_forever=True))
    cfg = load_config(dict(run=a.run, job=a.job, rank=a.rank, world_size=a.world, local_rank=a.rank % a.ranks_per_node,
                           exporter=True, port=0, nvml=False, alerts=False, hang_factor=5.0, hang_floor_seconds=1.0,
                           goodput_warmup_steps=2, auto_checkpoint_phases=False))
    info = RunInfo(run=cfg.run, rank=a.rank, local_rank=cfg.local_rank, world_size=a.world,
                   host=f"sim-node-{a.rank // a.ranks_per_node}", device="cpu", dtype="bf16",
                   peak_flops_per_second=a.peak, peak_source="user (peak_flops)", flops_source="user",
                   job=resolve_job(cfg.run, cfg.job))
    exporter = Exporter(info)
    exporter.exposed_registry = job_labelled_view(exporter.registry, info.job)
    errors = ErrorCounter()
    errors.listeners.append(exporter.count_error)
    current = {"step": 0}
    fleet = FleetAccounting(FleetSettings.from_config(cfg), registry=exporter.registry, errors=errors,
                            write=Timeline(None).write, current_step=lambda: current["step"])
    url = exporter.serve(0, "127.0.0.1")
    info.exporter_url = url
    target = FileSDTarget(a.sd_dir, run=cfg.run, rank=a.rank, url=url, host="127.0.0.1")
    target.write()
    flops = (a.flops_per_step, a.flops_per_step)
    step, deadline = 0, time.perf_counter()
    report_start, report_steps = time.perf_counter(), 0
    last = deadline
    try:
        while True:
            if state["hang"]:
                stuck_in_data_loader()
            if state["eval_forever"]:
                stuck_in_eval(fleet)
            if state["eval_once"]:
                state["eval_once"] = False
                fleet.enter("eval")
                time.sleep(a.eval_seconds)
                fleet.exit("eval")
                # the agent restarts its step clock at a phase's end (mark_gap): so does this loop
                deadline = last = report_start = time.perf_counter()
                report_steps = 0
            period = a.step_seconds * (SLOWDOWN if state["slow"] else 1.0)
            start = deadline
            deadline = start + period
            wait = INPUT_BOUND_WAIT if state["input_bound"] else a.input_wait_ratio
            time.sleep(max(0.0, start + period * wait - time.perf_counter()))  # input wait
            fleet.forward_start()
            time.sleep(max(0.0, deadline - time.perf_counter()))
            step += 1
            current["step"] = step
            fleet.boundary(step)
            now = time.perf_counter()
            dt, last = now - last, now  # the step's measured time (the CPU "device")
            exporter.observe_steps(1, a.tokens_per_step, dt)
            fleet.on_interval(1, dt, a.tokens_per_step, lambda tps: flops)
            report_steps += 1
            if report_steps >= a.report_every:
                st = (now - report_start) / report_steps
                mfs = a.flops_per_step / st
                exporter.collector.update(step=StepMeasurement(
                    step=step, steps=report_steps, timestamp=time.time(), step_time_seconds=st,
                    tokens=a.tokens_per_step * report_steps, tokens_per_second=a.tokens_per_step / st,
                    model_flops=a.flops_per_step, hardware_flops=a.flops_per_step, model_flops_per_second=mfs,
                    mfu=mfs / a.peak, hfu=mfs / a.peak))
                report_start, report_steps = now, 0
    except KeyboardInterrupt:
        pass
    finally:
        target.remove()
        fleet.close()
        exporter.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
