"""Put torchtitan's own per-step tokens/s and MFU next to mfuwatch's (same run, same steps): a markdown table.

    python compare.py LOG TIMELINE LABEL [FIRST_STEP]

LOG: torchtitan's console output (``--metrics.log_freq 1``, ``--metrics.disable_color_printing``);
TIMELINE: the mfuwatch agent's timeline (``report_every_steps: 1``). Steps before FIRST_STEP (default 3)
are left out of the means: both sides compile, allocate and warm caches there.
"""

import json
import re
import statistics
import sys

LINE = re.compile(r"step:\s*(\d+)\s.*?tps:\s*([\d,]+).*?tflops:\s*([\d.]+).*?mfu:\s*([\d.]+)%")


def titan(path):
    out = {}
    for line in open(path, encoding="utf-8", errors="replace"):
        m = LINE.search(line)
        if m:
            out[int(m.group(1))] = dict(tps=float(m.group(2).replace(",", "")), tflops=float(m.group(3)),
                                        mfu=float(m.group(4)) / 100)
    return out


def agent(path):
    recs = [json.loads(x) for x in open(path) if x.strip()]
    steps = {r["step"]: r for r in recs if r.get("kind") == "step" and r.get("steps") == 1}
    run = [r for r in recs if r.get("kind") == "run"][-1]
    return steps, run


def main():
    log, tl, label = sys.argv[1:4]
    first = int(sys.argv[4]) if len(sys.argv) > 4 else 3
    t = titan(log)
    a, run = agent(tl)
    common = sorted(s for s in t if s in a and s >= first)
    print(f"### {label}\n")
    print(f"mfuwatch run record: flops_source={run.get('flops_source')} dtype={run.get('dtype')} "
          f"peak={run.get('peak_flops_per_second')} ({run.get('peak_source')}) gpu={run.get('gpu_name')}\n")
    print("| step | torchtitan tps | mfuwatch tokens/s | torchtitan MFU | mfuwatch MFU | torchtitan FLOPs/token "
          "| mfuwatch FLOPs/token |")
    print("|---|---|---|---|---|---|---|")
    for s in common:
        r = a[s]
        fpt_t = t[s]["tflops"] * 1e12 / t[s]["tps"] if t[s]["tps"] else 0
        fpt_a = r["model_flops"] / r["tokens"] if r["tokens"] else 0
        mfu = r.get("mfu")
        print(f"| {s} | {t[s]['tps']:,.0f} | {r['tokens_per_second']:,.0f} | {t[s]['mfu']:.4f} | "
              f"{mfu if mfu is None else f'{mfu:.4f}'} | {fpt_t:.4g} | {fpt_a:.4g} |")
    if common:
        mt = statistics.mean(t[s]["tps"] for s in common)
        ma = statistics.mean(a[s]["tokens_per_second"] for s in common)
        ut = statistics.mean(t[s]["mfu"] for s in common)
        ua = [a[s]["mfu"] for s in common if a[s].get("mfu") is not None]
        ua = statistics.mean(ua) if ua else float("nan")
        print(f"\nmeans over steps {common[0]}..{common[-1]}: torchtitan tps {mt:,.0f}, mfuwatch {ma:,.0f} "
              f"(ratio {ma / mt:.4f}); torchtitan MFU {ut:.4f}, mfuwatch {ua:.4f} (ratio {ua / ut:.4f})\n")


if __name__ == "__main__":
    main()
