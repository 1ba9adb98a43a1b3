"""Shared checks for the kernel tests (tests/kernels): device choice and per-dtype tolerances."""

import os

import torch

#: Where the kernel tests put tensors: CPU tensors run in Triton's interpreter (TRITON_INTERPRET=1,
#: set by tests/kernels/conftest.py); MFUWATCH_KERNEL_TESTS_ON_GPU=1 runs them compiled on CUDA.
DEVICE = "cuda" if os.environ.get("MFUWATCH_KERNEL_TESTS_ON_GPU") == "1" else "cpu"

#: Tolerance per dtype, relative to the reference's largest magnitude plus elementwise.
#: bf16 has an 8-bit significand (2**-8 = 3.9e-3 per rounding) and fp16 an 11-bit one
#: (4.9e-4); the fused ops round once or twice (Llama casting), the references never.
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def assert_close(actual: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str = "",
                 scale: float = 1.0) -> None:
    """|actual - ref| <= tol * (|ref| + max|ref|) elementwise, tol = TOL[dtype] * scale.

    ``ref`` is a float64 reference computed independently; shapes must match
    and ``actual`` must be finite.
    """
    assert actual.shape == ref.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(ref.shape)}"
    a = actual.detach().to(torch.float64).cpu()
    r = ref.detach().to(torch.float64).cpu()
    assert torch.isfinite(a).all(), f"{what}: non-finite values"
    if r.numel() == 0:
        return
    tol = TOL[dtype] * scale
    bound = tol * (r.abs() + r.abs().max())
    err = (a - r).abs()
    assert bool((err <= bound).all()), f"{what}: max error {float(err.max()):.3e} exceeds tolerance (tol {tol:.1e})"


def assert_compiles_in_subprocess(script: str, expected: int) -> None:
    """Run ``script`` (Triton AOT compiles for a GPU target, ending with ``print("compiled", n)``) in a fresh
    interpreter without ``TRITON_INTERPRET`` and assert it compiled ``expected`` kernels; skips when this Triton
    has no AOT compile API (``triton.backends.compiler``)."""
    import importlib.util
    import subprocess
    import sys

    import pytest

    if importlib.util.find_spec("triton.backends.compiler") is None:
        pytest.skip("this triton has no AOT compile API (triton.backends.compiler)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, f"stdout: {proc.stdout[-3000:]}\nstderr: {proc.stderr[-5000:]}"
    assert proc.stdout.strip().endswith(f"compiled {expected}"), proc.stdout
