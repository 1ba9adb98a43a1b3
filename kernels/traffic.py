"""Minimal bytes each fused kernel must move to and from device memory (no torch, no triton).

These are the counts the suggestions registry and the agent's expected-gain
estimate use (time of the fused replacement = bytes / measured bandwidth), and
the "achieved bandwidth" denominators of ``benchmarks/kernels.py``. Each
tensor the op must read or write is counted once; per-row statistics
(``mean``/``rstd``, 4 bytes per row) and fp32 partial sums are implementation
details and are left out. With ``E = rows * hidden`` elements of ``b`` bytes
and a weight/bias of ``hidden`` elements of ``wb`` bytes:

==============  ===============================  =====================================
kernel          forward                          backward
==============  ===============================  =====================================
rms_norm        read x, w; write y:              read x, dy, w; write dx, dw:
                ``2*E*b + H*wb``                 ``3*E*b + 2*H*wb``
layer_norm      ``2*E*b + 2*H*wb`` (w and b)     ``3*E*b + 4*H*wb`` (reads w, b; dw, db)
add_rms_norm    read x, residual, w; write y,    read s, dy, d(new residual), w; write
                new residual: ``4*E*b + H*wb``   d(sum), dw: ``4*E*b + 2*H*wb``
swiglu, geglu   read gate, up; write y:          read gate, up, dy; write dgate, dup:
                ``3*E*b`` (hidden = the          ``5*E*b``
                intermediate size)
rotary          read x; write x_embed: ``2*E*b``  read dy; write dx: ``2*E*b``
                (one of q, k: rows = B*H*T,       (cos/sin: ``2*B*T*R`` elements per
                hidden = D)                       call, shared by all heads, left out)
cross_entropy   read the logits: ``E*b``          read the logits, write dlogits:
                (hidden = the vocabulary V;      ``2*E*b`` (the per-row loss and
                E = tokens x V)                  log-sum-exp, 4 bytes each, left out)
==============  ===============================  =====================================

``cross_entropy`` is also the count for the chunked LM head + loss (``linear_cross_entropy``), whose
logits chunks are formed by the GEMM and read back by the loss kernel while hot: the GEMMs' own operands
are counted with the matmuls, not here.
"""

from __future__ import annotations

# (activation multiple of E*b, weight-vector multiple of H*wb) per kernel, forward and backward
_FWD = {"rms_norm": (2, 1), "layer_norm": (2, 2), "add_rms_norm": (4, 1), "swiglu": (3, 0), "geglu": (3, 0),
        "rotary": (2, 0), "cross_entropy": (1, 0)}
_BWD = {"rms_norm": (3, 2), "layer_norm": (3, 4), "add_rms_norm": (4, 2), "swiglu": (5, 0), "geglu": (5, 0),
        "rotary": (2, 0), "cross_entropy": (2, 0)}


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
        Bytes (int). Raises ValueError for an unknown kernel or negative sizes.
    """
    table = _BWD if backward else _FWD
    if kernel not in table:
        raise ValueError(f"unknown kernel {kernel!r}; accepted: {', '.join(_FWD)}")
    if rows < 0 or hidden < 0 or dtype_bytes <= 0:
        raise ValueError(f"rows={rows}, hidden={hidden}, dtype_bytes={dtype_bytes}: sizes must be >= 0")
    act, wvec = table[kernel]
    wb = dtype_bytes if weight_bytes is None else weight_bytes
    return act * rows * hidden * dtype_bytes + wvec * hidden * wb
