"""Rows that start past 2**31 elements are addressed with int64 offsets, not wrapped int32 ones.

A (3, N) view with a row stride of 2**30 elements puts row 2 at element 2**31 of a
4 GiB (bf16) buffer that is allocated but never touched except where the rows are, so
the test needs little memory. With 32-bit offsets the kernel would read from a wrapped
address: wrong values or a crash, hence the subprocess.
"""

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import os
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    import mfuwatch.kernels as mk

    N, STRIDE = 64, 2**30
    base = torch.empty(2 * STRIDE + 4 * N, dtype=torch.bfloat16)   # 2**31 + 256 elements, untouched
    base2 = torch.empty(2 * STRIDE + 4 * N, dtype=torch.bfloat16)
    x = base.as_strided((3, N), (STRIDE, 1))
    dy = base2.as_strided((3, N), (STRIDE, 1))
    g = torch.Generator().manual_seed(0)
    x.copy_(torch.randn(3, N, generator=g))
    dy.copy_(torch.randn(3, N, generator=g))
    w = torch.randn(N, generator=g).to(torch.bfloat16)
    xc, dyc = x.contiguous(), dy.contiguous()

    def fwd_bwd(fn, a, d):
        a = a.detach().requires_grad_()
        y = fn(a)
        (gx,) = torch.autograd.grad(y, a, d)
        return y, gx

    for name, fn in [("rms_norm", lambda a: mk.rms_norm(a, w)),
                     ("layer_norm", lambda a: mk.layer_norm(a, (N,), w, w)),
                     ("swiglu", lambda a: mk.swiglu(a, a))]:
        y, gx = fwd_bwd(fn, x, dy)
        yc, gxc = fwd_bwd(fn, xc, dyc)
        assert torch.equal(y, yc), name + ": forward differs"
        assert torch.equal(gx, gxc), name + ": backward differs"
    print("ok")
    """
)


def test_rows_past_2_pow_31_elements():
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), (
        f"exit {proc.returncode}\nstdout: {proc.stdout[-2000:]}\nstderr: {proc.stderr[-2000:]}")
