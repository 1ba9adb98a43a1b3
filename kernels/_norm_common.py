"""What the three norms' functionals share: argument checks, the casting modes, and the empty-row case."""

from __future__ import annotations

from typing import Optional

import torch

def empty_width_norm(x: torch.Tensor, weight: Optional[torch.Tensor], offset: float, llama: bool,
                     bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A norm (RMSNorm or LayerNorm) of rows with no elements: an empty tensor shaped like ``x``.

    Its dtype is the op's (``promote(x, weight)`` under Llama casting with a weight, else ``x.dtype``) and it
    is computed by torch ops, so autograd links it to ``x``, ``weight`` and ``bias`` (their gradients: empty
    tensors in their own dtypes), as torch's norms do. The kernels need at least one element per row.
    """
    dt = torch.promote_types(x.dtype, weight.dtype) if (llama and weight is not None) else x.dtype
    y = x.to(dt) * 0
    if weight is not None:
        y = y * (weight.to(dt) + offset)
    return y if bias is None else y + bias.to(dt)


def check_rms_inputs(x: torch.Tensor, weight: Optional[torch.Tensor]) -> None:
    """ValueError for a 0-d ``x``, or a ``weight`` not shaped ``(x.shape[-1],)`` (as ``F.rms_norm`` requires of
    its weight: the RMSNorm functionals normalise the last dimension; the modules flatten several)."""
    if x.dim() == 0:
        raise ValueError("input is a 0-d tensor: RMSNorm needs at least one dimension to normalise over")
    if weight is not None and tuple(weight.shape) != (x.shape[-1],):
        raise ValueError(f"weight shape {tuple(weight.shape)} != ({x.shape[-1]},), the input's last dimension")


#: RMSNorm casting modes (see :mod:`.rms_norm`).
CASTINGS = ("auto", "llama", "fp32")


def resolve_casting(casting: str, offset: float) -> bool:
    """True for Llama casting. Raises ValueError for a mode not in :data:`CASTINGS`."""
    if casting == "auto":
        return offset == 0.0
    if casting not in CASTINGS:
        raise ValueError(f"casting={casting!r}: expected one of {CASTINGS}")
    return casting == "llama"
