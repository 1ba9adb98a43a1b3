"""Minimal bytes each fused kernel must move to and from device memory (no torch, no triton).

These are the counts the remedies table and the agent's expected-gain
estimate use (time of the fused replacement = bytes / measured bandwidth), and
the "achieved bandwidth" denominators of ``benchmarks/kernels.py``. Each
tensor the op must read or write is counted once; per-row statistics
(``mean``/``rstd``, 4 bytes per row) and fp32 partial sums are implementation
details and are left out. With ``E = rows * hidden`` elements of ``b`` bytes
and a weight/bias of ``H = hidden`` elements of ``wb`` bytes, a pass moves
``activations * E * b + weights * H * wb``; each kernel declares its two multiples,
forward and backward, with what they count, in its op module's ``FACTS``
(:class:`~._facts.Bytes`): e.g. ``rms_norm`` forward reads x, w and writes y
(``2*E*b + H*wb``), backward reads x, dy, w and writes dx, dw (``3*E*b + 2*H*wb``).

``cross_entropy`` is also the count for the chunked LM head + loss (``linear_cross_entropy``), whose
logits chunks are formed by the GEMM and read back by the loss kernel while hot: the GEMMs' own operands
are counted with the matmuls, not here.
"""

from __future__ import annotations

from ._facts import facts


def minimal_bytes(kernel: str, rows: int, hidden: int, dtype_bytes: int = 2, *, backward: bool = False,
                  weight_bytes: int | None = None) -> int:
    """Bytes the fused ``kernel`` must move for a ``rows x hidden`` input.

    Args:
        kernel: a name in ``mfuwatch.kernels.AVAILABLE_KERNELS``.
        rows: rows (tokens) of the input; hidden: its last dimension (for the
            GLUs, the intermediate size, i.e. ``gate.shape[-1]``).
        dtype_bytes: bytes per activation element (2 for bf16/fp16, 4 for fp32).
        backward: the backward pass instead of the forward.
        weight_bytes: bytes per weight element (default ``dtype_bytes``).
    Returns:
        Bytes (int): the kernel's declared count (:meth:`~._facts.KernelFacts.minimal_bytes`).
        Raises ValueError for an unknown kernel or negative sizes.
    """
    kf = facts(kernel)
    if rows < 0 or hidden < 0 or dtype_bytes <= 0:
        raise ValueError(f"rows={rows}, hidden={hidden}, dtype_bytes={dtype_bytes}: sizes must be >= 0")
    return kf.minimal_bytes(rows, hidden, dtype_bytes, backward=backward, weight_bytes=weight_bytes)
