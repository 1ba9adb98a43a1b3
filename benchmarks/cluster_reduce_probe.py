"""Whether the installed Triton can split one row across a Hopper thread-block cluster and reduce it on chip.

A cross-entropy that reads each logit from HBM once must hold a whole row (128256 bf16 logits: 250 KiB, more
than an H100/H200 SM's 228 KiB of shared memory and nearly all of its 256 KiB register file) on chip until its
log-sum-exp is known; a cluster of 2-4 CTAs holds it between them and reduces through distributed shared memory
(DSMEM). This script asks Triton to compile, for
sm_90 and without a GPU, a row softmax of 65536 elements with ``num_ctas`` = 1, 2 and 4, and prints for each
whether it lowered and how many cluster instructions its PTX holds (``mapa``: a peer CTA's shared-memory
address; ``shared::cluster`` accesses; ``barrier.cluster``)::

    python3 benchmarks/cluster_reduce_probe.py          # about 10 seconds, CPU only

What Triton 3.6.0 and 3.9.0 did: ``docs/benchmarks.md`` (issue 27, run 13) and ``docs/gpu-runs/cross_entropy-run13.md``.
"""

from __future__ import annotations

import sys

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

BLOCK = 65536
WARPS = 32


@triton.jit
def _row_softmax(X, Y, BLOCK: tl.constexpr):
    """Softmax of one BLOCK-long bf16 row per program (max and sum over the whole row)."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    x = tl.load(X + row * BLOCK + cols).to(tl.float32)
    m = tl.max(x, axis=0)
    s = tl.sum(tl.exp(x - m), axis=0)
    tl.store(Y + row * BLOCK + cols, (tl.exp(x - m) / s).to(tl.bfloat16))


def main() -> int:
    print(f"Triton {triton.__version__}: row softmax of {BLOCK} bf16 elements, {WARPS} warps, sm_90")
    print("| num_ctas | lowered | mapa | shared::cluster | barrier.cluster |")
    print("|---|---|---|---|---|")
    lowered_multi = False
    for n in (1, 2, 4):
        try:
            c = triton.compile(ASTSource(_row_softmax, dict(X="*bf16", Y="*bf16"), dict(BLOCK=BLOCK)),
                               target=GPUTarget("cuda", 90, 32), options=dict(num_warps=WARPS, num_ctas=n))
        except Exception as e:  # noqa: BLE001 - the failure is the finding
            print(f"| {n} | no: {type(e).__name__}: {str(e).splitlines()[0][:80]} | | | |")
            continue
        ptx = c.asm["ptx"]
        print(f"| {n} | yes | {ptx.count('mapa')} | {ptx.count('shared::cluster')} | {ptx.count('barrier.cluster')} |")
        lowered_multi |= n > 1
    print("cluster-split rows:", "supported" if lowered_multi else "not supported by this Triton")
    return 0


if __name__ == "__main__":
    sys.exit(main())
