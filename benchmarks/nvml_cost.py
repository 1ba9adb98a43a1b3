"""Cost of the NVML sampler, and GPM activity under known workloads (needs an NVIDIA GPU).

    python3 benchmarks/nvml_cost.py [--device 0] [--reps 2000] [--seconds 2]

1. Per-call cost of every NVML query the sampler makes (mean / p50 / p99 in microseconds over
   ``--reps`` calls), of the three basic ones together (utilization, power, SM clock), and of one
   full ``NvmlSampler.sample()``; the share of one 1 Hz interval that a sample costs.
2. GPM SM / tensor / DRAM activity (``mfuwatch.agent.device.nvml.gpm_ratios``) over ``--seconds`` while
   idle, while a bf16 8192^3 matmul loop runs, and while a 1 GiB copy loop runs, beside the
   matmul's achieved FLOP/s over the datasheet peak (the tensor-active ratio should be at least
   that ratio, and DRAM activity should lead under the copy loop).
3. PASS/FAIL checks: the sampler opened and every GpuHealth field was read; the GPU resolves in
   the peak table; the expected GPM ordering holds.

Prints markdown tables; writes them to $OUT/nvml_cost.md and the raw numbers to
$OUT/nvml_cost.json when OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from mfuwatch.agent.device import peaks
from mfuwatch.agent.device.nvml import NvmlSampler, gpm_ratios
from mfuwatch.agent.device.nvml_device import open_nvml, read_gpm


def time_call(fn, reps: int):
    """(mean, p50, p99) microseconds per call, or the error text."""
    try:
        for _ in range(10):
            fn()
    except Exception as exc:  # noqa: BLE001 - report unsupported queries in the table
        return f"error: {type(exc).__name__} {exc}"
    ns = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        fn()
        ns.append(time.perf_counter_ns() - t0)
    ns.sort()
    return statistics.fmean(ns) / 1e3, ns[len(ns) // 2] / 1e3, ns[int(len(ns) * 0.99) - 1] / 1e3


def fmt(value) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--reps", type=int, default=2000)
    ap.add_argument("--seconds", type=float, default=2.0)
    args = ap.parse_args()
    dev = torch.device("cuda", args.device)
    torch.cuda.set_device(dev)
    out_lines, results, checks = [], {}, []

    def emit(line=""):
        print(line)
        out_lines.append(line)

    # ---------------------------------------------------------------- 1. cost per call
    nv, h, index = open_nvml(dev, None)
    es = nv.nvmlEventSetCreate()
    try:
        nv.nvmlDeviceRegisterEvents(h, nv.nvmlEventTypeXidCriticalError, es)
    except Exception as exc:  # noqa: BLE001
        emit(f"(Xid event registration failed: {exc})")

    def xid_poll():
        try:
            nv.nvmlEventSetWait(es, 0)
        except nv.NVMLError_Timeout:
            pass

    s1, s2 = nv.nvmlGpmSampleAlloc(), nv.nvmlGpmSampleAlloc()
    try:
        nv.nvmlGpmSampleGet(h, s1)
        time.sleep(0.2)
        nv.nvmlGpmSampleGet(h, s2)
    except Exception as exc:  # noqa: BLE001 - no GPM on this GPU: its rows show the error
        emit(f"(GPM samples failed: {exc})")
    calls = {
        "utilization": lambda: nv.nvmlDeviceGetUtilizationRates(h),
        "sm_clock": lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM),
        "power": lambda: nv.nvmlDeviceGetPowerUsage(h),
        "power_limit": lambda: nv.nvmlDeviceGetEnforcedPowerLimit(h),
        "temperature": lambda: nv.nvmlDeviceGetTemperatureV(h, nv.NVML_TEMPERATURE_GPU),
        "memory": lambda: nv.nvmlDeviceGetMemoryInfo(h),
        "energy": lambda: nv.nvmlDeviceGetTotalEnergyConsumption(h),
        "clock_event_reasons": lambda: nv.nvmlDeviceGetCurrentClocksEventReasons(h),
        "ecc (one of two)": lambda: nv.nvmlDeviceGetTotalEccErrors(
            h, nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, nv.NVML_VOLATILE_ECC),
        "xid poll (EventSetWait, timeout 0)": xid_poll,
        "gpm sample get": lambda: nv.nvmlGpmSampleGet(h, s2),
        "gpm metrics get (3 metrics)": lambda: read_gpm(nv, s1, s2),
        "3 basic calls (utilization+power+clock)": lambda: (
            nv.nvmlDeviceGetUtilizationRates(h), nv.nvmlDeviceGetPowerUsage(h),
            nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM)),
    }
    errors = []

    def new_sampler():
        s = NvmlSampler(torch_device=dev, on_sample=lambda g: None, on_error=lambda c, e: errors.append((c, repr(e))))
        return s if s.open() else None

    cost_sampler = new_sampler()
    checks.append(("sampler opened", cost_sampler is not None))
    if cost_sampler is not None:
        cost_sampler.sample()  # the first GPM sample
        calls["NvmlSampler.sample() (all fields)"] = cost_sampler.sample

    emit(f"## NVML cost per call ({torch.cuda.get_device_name(dev)}, NVML index {index}, {args.reps} reps)")
    emit("")
    emit("| query | mean (us) | p50 (us) | p99 (us) |")
    emit("|---|---:|---:|---:|")
    for name, fn in calls.items():
        reps = args.reps if "sample()" not in name else max(args.reps // 10, 50)
        r = time_call(fn, reps)
        results[name] = r
        emit(f"| {name} | {r} | | |" if isinstance(r, str) else f"| {name} | {r[0]:.1f} | {r[1]:.1f} | {r[2]:.1f} |")
    if cost_sampler is not None:
        cost_sampler.close()
    full = results.get("NvmlSampler.sample() (all fields)")
    if isinstance(full, tuple):
        emit("")
        emit(f"One full sample costs {full[0]:.0f} us = {full[0] / 1e6 * 100:.4f} % of a 1 s interval "
             f"(on the sampler thread, not the training thread).")

    # ---------------------------------------------------------------- 2. GPM under workloads
    n = 8192
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    src = torch.empty(1 << 28, device=dev, dtype=torch.float32)  # 1 GiB
    dst = torch.empty_like(src)
    matmuls = [0]

    def matmul_loop():
        for _ in range(4):
            torch.mm(a, b)
        torch.cuda.synchronize()
        matmuls[0] += 4

    def copy_loop():
        for _ in range(4):
            dst.copy_(src)
        torch.cuda.synchronize()

    matmul_loop()
    copy_loop()
    name = torch.cuda.get_device_name(dev)
    pci = nv.nvmlDeviceGetPciInfo(h).pciDeviceId
    spec = peaks.lookup(name, pci)
    checks.append((f"'{name}' (PCI 0x{pci >> 16:04X}) resolves in the peak table"
                   f"{' -> ' + spec.name if spec else ''}", spec is not None))
    emit("")
    emit(f"## GPM activity over {args.seconds:g} s")
    emit("")
    emit("| workload | SM active | tensor active | DRAM active | matmul FLOP/s / datasheet bf16 peak |")
    emit("|---|---:|---:|---:|---:|")
    gpm = {}
    for label, work in (("idle", None), ("bf16 8192^3 matmul loop", matmul_loop), ("1 GiB copy loop", copy_loop)):
        matmuls[0] = 0
        t0 = time.perf_counter()
        try:
            r = gpm_ratios(dev, args.seconds, workload=work)
        except RuntimeError as exc:
            emit(f"| {label} | {exc} | | | |")
            continue
        elapsed = time.perf_counter() - t0
        ratio = ""
        if work is matmul_loop and spec is not None:
            achieved = matmuls[0] * 2.0 * n ** 3 / elapsed
            ratio = f"{achieved / spec.peak_flops['bf16']:.3f} ({achieved / 1e12:.0f} TFLOP/s)"
            r["matmul_fraction_of_peak"] = achieved / spec.peak_flops["bf16"]
        gpm[label] = r
        emit(f"| {label} | {fmt(r.get('sm_active'))} | {fmt(r.get('tensor_active'))} | "
             f"{fmt(r.get('dram_active'))} | {ratio} |")
    results["gpm"] = gpm
    mm, cp = gpm.get("bf16 8192^3 matmul loop", {}), gpm.get("1 GiB copy loop", {})
    if mm.get("tensor_active") is not None and cp.get("tensor_active") is not None:
        checks.append(("tensor active: matmul > 0.5 > copy", mm["tensor_active"] > 0.5 > cp["tensor_active"]))
        checks.append(("DRAM active: copy > matmul", (cp.get("dram_active") or 0) > (mm.get("dram_active") or 0)))
        if "matmul_fraction_of_peak" in mm:
            checks.append(("tensor active >= 0.9 x matmul FLOP/s over peak",
                           mm["tensor_active"] >= 0.9 * mm["matmul_fraction_of_peak"]))

    # ---------------------------------------------------------------- 3. checks
    chk = new_sampler()
    if chk is not None:
        chk.sample()
        t_end = time.perf_counter() + 1.0
        while time.perf_counter() < t_end:
            matmul_loop()
        g = chk.sample()  # GPM over the busy second
        missing = [k for k in ("utilization", "sm_clock_hertz", "power_watts", "power_limit_watts",
                               "temperature_celsius", "memory_used_bytes", "energy_joules", "tensor_active")
                   if getattr(g, k) is None]
        checks.append((f"GpuHealth fields read (missing: {missing or 'none'}; reasons {g.clock_event_reasons})",
                       not missing))
        results["last_sample"] = g.__dict__
        chk.close()
    results["errors"] = errors
    emit("")
    emit("## Checks")
    emit("")
    for text, ok in checks:
        emit(f"- {'PASS' if ok else 'FAIL'}: {text}")
    if errors:
        emit(f"- sampler errors: {errors}")
    nv.nvmlGpmSampleFree(s1)
    nv.nvmlGpmSampleFree(s2)
    nv.nvmlEventSetFree(es)
    nv.nvmlShutdown()
    out = os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "nvml_cost.md"), "w") as fh:
            fh.write("\n".join(out_lines) + "\n")
        with open(os.path.join(out, "nvml_cost.json"), "w") as fh:
            json.dump(results, fh, indent=1, default=str)
    return 0 if all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    raise SystemExit(main())
