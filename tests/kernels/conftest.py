"""Kernel tests run on the CPU in Triton's interpreter (TRITON_INTERPRET=1), set before triton loads.

Triton decides interpreter-or-GPU when it decorates a kernel, i.e. when a
kernel module is first imported, so the variable must be set before anything
imports the ``mfuwatch.kernels`` ops (pytest imports this file before the
tests of this folder). On a machine with a CUDA GPU,
``MFUWATCH_KERNEL_TESTS_ON_GPU=1`` runs the same tests compiled on the GPU.
"""

import os

if os.environ.get("MFUWATCH_KERNEL_TESTS_ON_GPU") != "1":
    os.environ["TRITON_INTERPRET"] = "1"

import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

# The kernel modules may have been imported (compiled mode) by another test directory collected
# earlier; then these tests cannot run on the CPU. Say so in each test rather than abort the session.
_IMPORTED_TOO_EARLY = (os.environ.get("TRITON_INTERPRET") == "1" and "mfuwatch.kernels._env" in sys.modules
                       and not sys.modules["mfuwatch.kernels._env"].INTERPRET)


@pytest.fixture(autouse=True)
def _interpreter_guard():
    if _IMPORTED_TOO_EARLY:
        pytest.fail("mfuwatch.kernels ops were imported before TRITON_INTERPRET=1 was set; set it in the "
                    "environment (or in tests/conftest.py) before the test session starts")


@pytest.fixture
def gen():
    """A generator with a fresh seed per test (fresh random inputs), printed for reproducing a failure."""
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"random seed {seed}")  # pytest shows it when the test fails
    return torch.Generator().manual_seed(seed)
