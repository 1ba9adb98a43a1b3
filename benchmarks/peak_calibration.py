"""Measured matmul FLOP/s and copy bandwidth against the datasheet row of this GPU (needs a GPU).

    python3 benchmarks/peak_calibration.py [--device 0]

For each dtype key of the peak table (fp32 with TF32 off, tf32, bf16, fp16, fp8) it runs
``mfuwatch.agent.device.calibrate.calibrate_matmul`` (8192^3 matmul, CUDA events) and prints the result
beside the table's dense peak; then ``calibrate_bandwidth`` (1 GiB copy) beside the HBM peak.

What to expect on a correct row: measured / table between about 0.6 and 1.0 for the tensor
dtypes (cuBLAS reaches 70-85 % of the dense peak at this size) and never above ~1.05. A ratio
near 0.35-0.5 would mean the table holds a sparse figure; above 1.05, a too-low figure.
Exits 1 when a check fails. Writes $OUT/peak_calibration.md when OUT is set.
"""

from __future__ import annotations

import argparse
import os

import torch

from mfuwatch.agent.device import calibrate, peaks


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", type=int, default=0)
    args = ap.parse_args()
    dev = torch.device("cuda", args.device)
    torch.cuda.set_device(dev)
    name = torch.cuda.get_device_name(dev)
    spec = peaks.lookup(name)
    lines = [f"## Peak calibration on {name} (table row: {spec.name if spec else 'none'})", "",
             "| dtype | measured (TFLOP/s) | table dense peak (TFLOP/s) | measured / table |", "|---|---:|---:|---:|"]
    ok = spec is not None
    for key in peaks.DTYPES:
        try:
            measured = calibrate.calibrate_matmul(dev, key)
        except Exception as exc:  # noqa: BLE001 - e.g. no fp8 on this GPU or torch
            lines.append(f"| {key} | {type(exc).__name__}: {exc} | | |")
            continue
        table = spec.peak_flops.get(key) if spec else None
        ratio = measured / table if table else None
        if ratio is not None and key != "fp32" and not 0.5 <= ratio <= 1.05:
            ok = False
        lines.append(f"| {key} | {measured / 1e12:.1f} | {table / 1e12 if table else 'n/a'} | "
                     f"{f'{ratio:.3f}' if ratio is not None else 'n/a'} |")
    bw = calibrate.calibrate_bandwidth(dev)
    table_bw = spec.memory_bandwidth_bytes_per_second if spec else None
    lines += ["", "| copy | measured (TB/s) | table (TB/s) | measured / table |", "|---|---:|---:|---:|",
              f"| 1 GiB device copy | {bw / 1e12:.2f} | {table_bw / 1e12 if table_bw else 'n/a'} | "
              f"{bw / table_bw:.3f} |" if table_bw else f"| 1 GiB device copy | {bw / 1e12:.2f} | n/a | n/a |"]
    if table_bw and not 0.5 <= bw / table_bw <= 1.05:
        ok = False
    lines += ["", f"{'PASS' if ok else 'FAIL'}: every tensor dtype and the copy within 0.5..1.05 of the table"]
    print("\n".join(lines))
    out = os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "peak_calibration.md"), "w") as fh:
            fh.write("\n".join(lines) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
