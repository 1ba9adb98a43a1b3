"""Static SASS instruction counts per element of the cross-entropy kernels' inner loops, on any machine (no GPU).

Compiles each kernel for sm_90 with Triton's AOT path (the ptxas and nvdisasm bundled in the triton wheel), finds
each loop (a backward branch in the disassembly) and prints its instructions, divided by the elements one thread
handles per iteration (BLOCK / (32 * warps)), with the opcode mix. The launchers' specialisation is reproduced:
pointers, the row strides and V 16-divisible (so loads are 16-byte vectors, as for V = 128256). The Triton here may
differ from the GPU machine's: take the counts as the shape of the code, and ncu's ``sm__inst_executed`` for what
ran (docs/gpu-runs/cross_entropy-run9.md has both)::

    TRITON_DEFAULT_FP_FUSION=1 python benchmarks/cross_entropy_sass.py
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import mfuwatch.kernels._cross_entropy_triton as K

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
SIG = dict(X="*bf16", T="*i64", LOSS="*fp32", LSE="*fp32", DX="*bf16", SCALE="*fp32", rows="i32", stride_x="i32",
           stride_dx="i32", V="i32", ignore_index="i32", smoothing="fp32", z_loss="fp32", softcap="fp32")


def disasm(fn, sig, consts, warps):
    names = list(fn.arg_names)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in sig
             if sig[n].startswith("*") or n in ("stride_x", "stride_dx", "V")}
    k = triton.compile(ASTSource(fn, sig, consts, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=warps))
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    try:
        return subprocess.run([os.path.join(BIN, "nvdisasm"), "-c", f.name], capture_output=True, text=True,
                              check=True).stdout
    finally:
        os.unlink(f.name)


def loops(text):
    """[(first address, last address, [(address, instruction)])] for each backward branch."""
    ins, labels, cur = [], {}, None
    for line in text.splitlines():
        ml = re.match(r"^(\.L_x_\d+):", line)
        if ml:
            labels[ml.group(1)] = None
            cur = ml.group(1)
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m:
            a = int(m.group(1), 16)
            if cur is not None and labels[cur] is None:
                labels[cur] = a
            ins.append((a, m.group(2).strip()))
    out = []
    for a, t in ins:
        mb = re.search(r"BRA\s+`\((\.L_x_\d+)\)", t)
        if mb and labels.get(mb.group(1)) is not None and labels[mb.group(1)] < a:
            lo = labels[mb.group(1)]
            out.append((lo, a, [x for x in ins if lo <= x[0] <= a]))
    return out


def opcode(t):
    return re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0]


def report(name, fn, sig, consts, warps):
    per_thread = consts["BLOCK"] // (32 * warps)
    # the innermost loops: those containing no other loop
    ls = loops(disasm(fn, sig, consts, warps))
    inner = [l for l in ls if not any(o is not l and l[0] <= o[0] and o[1] <= l[1] for o in ls)]
    for i, (_, _, body) in enumerate(inner):
        c = collections.Counter(opcode(t) for _, t in body)
        print(f"| {name} | loop {i + 1} | {len(body) / per_thread:.1f} | {c['MUFU'] / per_thread:.1f} | "
              + " ".join(f"{o}:{n}" for o, n in c.most_common(10)) + " |")


def main():
    print("| kernel (BLOCK, warps; flags) | loop | instructions per element | MUFU per element | opcode mix (per "
          "iteration of one thread) |")
    print("|---|---|---|---|---|")
    for cap in (False, True):
        report(f"rev (2048, 4; softcap {cap})", K._ce_fwd_kernel, SIG,
               dict(HAS_SOFTCAP=cap, WRITE_GRAD=True, HINTS=False, BLOCK=2048, STAGES=4, REVERSE=True, LANES=False), 4)
    sig = dict(SIG, kexp="fp32")
    for cap, block, warps, local, newton in ((False, 2048, 4, False, 0), (False, 4096, 4, False, 0),
                                             (False, 8192, 8, True, 0), (True, 2048, 4, False, 0),
                                             (True, 2048, 4, False, 3), (True, 4096, 4, True, 0),
                                             (True, 4096, 4, True, 1)):
        report(f"fast ({block}, {warps}; softcap {cap}, local {local}, newton {newton})", K._ce_fast_kernel, sig,
               dict(HAS_SOFTCAP=cap, SMOOTH=False, ZLOSS=False, HINTS=False, BLOCK=block, STAGES=3,
                    NEWTON1=bool(newton & 1), NEWTON2=bool(newton & 2), ASM=True, LOCAL=local, VEC=8,
                    FIXED=local and cap), warps)


if __name__ == "__main__":
    main()
