"""Session-wide test set-up.

The suite runs on the CPU: Triton kernels run in Triton's interpreter, which
must be chosen (``TRITON_INTERPRET=1``) before any kernel module is imported —
Triton decides interpreter-or-GPU when it decorates a kernel. This root
conftest is imported before every test folder's, so any folder may import
``mfuwatch.kernels``. On a CUDA machine, ``MFUWATCH_KERNEL_TESTS_ON_GPU=1``
keeps the kernels compiled for the GPU.
"""

import os

if os.environ.get("MFUWATCH_KERNEL_TESTS_ON_GPU") != "1":
    os.environ["TRITON_INTERPRET"] = "1"
