"""What the cross-entropy launch-setting benchmarks share (``cross_entropy_team.py``, ``cross_entropy_fast.py``):
setting strings, the float64 reference, the relative error and one fused launch. GPU scripts; no timing here."""

from __future__ import annotations

import torch

import mfuwatch.kernels._cross_entropy_triton as K

DEV = "cuda"


def parse(s):
    """'BLOCK,warps,kind,pps,flags' -> the setting tuple ce_fwd takes."""
    b, w, k, p, f = s.split(",")
    return int(b), int(w), k, int(p), int(f)


def ref(x, t, eps, zl, cap):
    """float64 loss rows and gradient of their sum times 0.5 (ignore_index -100)."""
    x64 = x.double().requires_grad_()
    z = cap * torch.tanh(x64 / cap) if cap else x64
    lse = torch.logsumexp(z, -1)
    keep = t != -100
    tt = torch.where(keep, t, 0)
    logp = z - lse[:, None]
    rows = -(1 - eps) * logp.gather(1, tt[:, None])[:, 0] - eps * logp.mean(-1) + zl * lse ** 2
    rows = torch.where(keep, rows, 0.0)
    (rows.sum() * 0.5).backward()
    return rows.detach(), x64.grad


def rel(a, b):
    """Relative L2 error of ``a`` against ``b`` (float64), NaN when ``a`` is not finite."""
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("nan")
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def run(x, t, setting, eps=0.0, zl=0.0, cap=0.0, dx=None):
    """One ``ce_fwd`` launch writing the loss rows, the lse and the gradient (scale 0.5, ignore_index -100)."""
    dx = torch.empty_like(x) if dx is None else dx
    loss, lse = K.ce_fwd(x, t, -100, eps, zl, cap, grad_scale=torch.full((1,), 0.5, device=DEV), dx=dx,
                         setting=setting)
    return loss, lse, dx
