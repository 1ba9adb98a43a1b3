"""A small training job for the preemption and fork tests: ``python preempt_job.py MODE TIMELINE SD_DIR``.

The agent runs with a timeline, a file-SD target, and one rule that fires at the first report (MFU far
below its threshold: flops_per_step 1e3 against a 1e15 FLOP/s peak), notified to the webhook URL in
``$MFUWATCH_TEST_HOOK``. Modes:

``loop``     step until killed (the test sends the signal)
``user``     as ``loop``, with a SIGTERM handler installed before the agent that writes ``TIMELINE.user``
             and exits with status 7
``after``    the same handler installed after the agent started (it replaces the agent's)
``error``    raise RuntimeError after 40 steps inside the agent's with-block
``fork``     fork after 30 steps; the child exits with status 3 through the normal interpreter exit
             (atexit included); the parent waits for it (10 s at most), prints ``child status N``,
             scrapes its own exporter, steps on and exits 0
``flag``     as ``loop``, with a SIGTERM handler installed before the agent that appends the signal number to
             ``TIMELINE.user`` and returns (a "stop soon" flag); the job ends at the next step, status 0

``graceful`` as ``flag``, but the job runs 20 more steps after the flag ("checkpoints"), then calls
             ``agent.close(reason="run preempted (SIGTERM)", budget_s=2.0)``, prints ``ran N`` (its steps) and exits 0

``$MFUWATCH_TEST_PREEMPT_TIMEOUT`` sets ``preemption_timeout_seconds`` (default 2), ``$MFUWATCH_TEST_PREEMPT_SIGNALS``
``preemption_signals`` (default ``SIGTERM,SIGUSR1``; empty: none). The ``.user`` file gets one line per call of
the user's handler.
"""

import os
import signal
import sys
import time
import urllib.request

from mfuwatch.agent import Agent

mode, timeline, sd_dir = sys.argv[1], sys.argv[2], sys.argv[3]
ALERTS = {"use_default_rules": False, "inhibit_rules": [], "evaluation_interval": "1s",
          "rules": {"MfuLow": {"expr": "mfu", "op": "<", "threshold": 0.25, "for": "0s", "cooldown": "30m",
                               "severity": "critical", "annotations": {"summary": "MFU is {value:pct}"}}},
          "notifiers": [{"type": "webhook", "url_env": "MFUWATCH_TEST_HOOK"}]}

stop = []


def on_term(signum, frame):
    with open(timeline + ".user", "a") as fh:
        fh.write(f"{signum}\n")
    if mode not in ("flag", "graceful"):
        sys.exit(7)
    stop.append(signum)


if mode in ("user", "flag", "graceful"):
    signal.signal(signal.SIGTERM, on_term)

with Agent(config=dict(run="preempt", port=0, nvml=False, profile_every="off", flops_per_step=1e3, peak_flops=1e15,
                       report_every_steps=10, timeline=timeline, file_sd_dir=sd_dir, alerts=ALERTS,
                       preemption_signals=os.environ.get("MFUWATCH_TEST_PREEMPT_SIGNALS", "SIGTERM,SIGUSR1"),
                       preemption_timeout_seconds=float(os.environ.get("MFUWATCH_TEST_PREEMPT_TIMEOUT", "2")))) as agent:
    if mode == "after":
        signal.signal(signal.SIGTERM, on_term)
    print("started", flush=True)
    n = 0
    while True:
        n += 1
        time.sleep(0.004)
        agent.step(tokens=16)
        if stop and mode == "graceful":
            stop.append(None)
            if len(stop) == 21:  # 20 steps after the flag, then the checkpoint and the close
                agent.close(reason="run preempted (SIGTERM)", budget_s=2.0)
                print(f"ran {n}", flush=True)
                break
        elif stop:
            break
        if mode == "error" and n == 40:
            raise RuntimeError("a bug in the training loop")
        if mode == "fork" and n == 30:
            pid = os.fork()
            if pid == 0:
                sys.exit(3)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    print(f"child status {os.waitstatus_to_exitcode(status)}", flush=True)
                    break
                time.sleep(0.01)
            else:
                os.kill(pid, signal.SIGKILL)
                print("child hung", flush=True)
            body = urllib.request.urlopen(agent.exporter_url, timeout=5).read().decode()
            print("parent scrape ok" if "mfuwatch_steps_total" in body else "parent scrape bad", flush=True)
        if mode == "fork" and n == 60:
            break
print("clean exit", flush=True)
