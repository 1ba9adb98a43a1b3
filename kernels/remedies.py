"""The remedies table: which profiled op patterns have which remedy, and what the remedy must move.

The agent (``mfuwatch.agent.analysis.suggest``) matches these entries against a profiler window
and turns each match into a :class:`mfuwatch.agent.schema.Suggestion` with an expected
gain. This module is plain data: it imports neither torch, triton nor anything from
``mfuwatch.agent``, so reading it is free.

Each :class:`Remedy` is either

* ``kind="existing"``: a feature torch already has (``fused=True`` optimizers, SDPA,
  ``torch.compile``, CUDA graphs, bf16 autocast). Ranked before any custom kernel: the
  field's discipline is to reach for the maintained fix first;
* ``kind="bundled"``: a Triton drop-in in :mod:`mfuwatch.kernels`, applied with
  ``mfuwatch.kernels.patch(model, kernels=[...])``. Each bundled entry is declared by its kernel,
  beside its ``autograd.Function`` (the ``remedy`` of the op module's ``FACTS``, :mod:`._facts`), and
  only names in ``mfuwatch.kernels.AVAILABLE_KERNELS`` may be bundled (a bundled :class:`Remedy` naming
  anything else raises); remedies for ops without a bundled kernel point to an existing fix and say so
  in their title.

How an entry finds its ops (first that applies):

* ``sequence``: consecutive *top-level* forward ops of one thread that launched work
  (views skipped), e.g. ``pow → mean → add → rsqrt → mul`` for an RMSNorm written out in
  PyTorch. Each :class:`Step` lists accepted op names; ``optional`` steps may be absent;
  ``gap`` lets that many unrelated ops sit before the step (they are not counted: in
  ``silu(gate(x)) * up(x)`` the ``up`` matmul runs between ``silu`` and ``mul``); with
  ``claim=False`` a step is matched but its time is not the remedy's. The backward ops
  autograd ran for the claimed ops (same ``Sequence number``) are claimed too, and so are those of the
  top-level ``views`` ops (names) that sit between the first and the last claimed op: a view launches
  nothing in the forward, so it is not in the op stream, but its backward can (``rotate_half``'s slices:
  ``SliceBackward0`` zero-fills a buffer, copies the gradient into it and adds the two halves).
  ``returns_input_layout`` marks a replacement whose backward writes the input gradients in the forward
  inputs' layout: when the anchor input is a permuted view (a transposed projection), the eager backward
  hands back a gradient of another layout, and the strided kernels it forces on the backward ops that
  receive it are credited to the remedy too (:func:`mfuwatch.agent.analysis.gain_model.relayout_credit`).
* ``region``: all ops inside a ``user_annotation`` whose name matches the regex
  (``Optimizer.step#AdamW.step``), unless one of them is in ``exclude`` (already fixed).
* ``detector``: a rule computed by the agent: ``"pointwise_chain"`` (runs of
  :data:`MIN_CHAIN` or more memory-bound pointwise ops), ``"launch_bound"`` (GPU idle gaps
  shorter than :data:`MAX_LAUNCH_GAP_SECONDS` in which the GPU waited for the next launch), ``"fp32_matmul"``
  (matmul-like ops with fp32 inputs on a GPU with bf16 tensor cores).

The **minimal bytes** of the replacement, for the expected gain, come from the *anchor*
tensor: input ``anchor_arg`` of the first claimed op named ``anchor_op`` (the first
claimed op when ``anchor_op`` is None), at its recorded dtype, its element counts summed
over the matched ops when ``anchor_sum``. For a bundled kernel they are
:func:`mfuwatch.kernels.traffic.minimal_bytes` (the kernel's declared bytes) of the anchor's ``rows × hidden`` shape
(forward, plus backward when backward ops were claimed): the same count the kernels'
own benchmarks use. For an existing fix they are ``passes_forward (+ passes_backward)
× anchor bytes``, a pass being one read or one write of the anchor tensor, counted by
writing out what the fused replacement reads and writes. ``keeps_flops`` marks
replacements that still do the matched ops' FLOPs (attention), whose time is at least
FLOPs / peak.
"""

from __future__ import annotations

from typing import Tuple

from ._facts import Remedy, Step, all_facts, aten, kernel_names  # plain Python: no torch/triton

__all__ = ["Remedy", "Step", "REMEDIES", "BUNDLED_KERNELS", "MIN_CHAIN", "MAX_LAUNCH_GAP_SECONDS"]

#: Existing fixes matched before the bundled kernels (the maintained fix first).
_FIRST: Tuple[Remedy, ...] = (
    Remedy(
        kernel="fused_adamw", kind="existing",
        title="Use the fused AdamW/Adam step (one kernel per parameter group instead of ~10 foreach kernels)",
        apply="optimizer = torch.optim.AdamW(model.parameters(), lr=lr, fused=True)",
        replaces="Optimizer.step#Adam(W).step: _foreach_* / multi_tensor_apply kernels",
        region=r"^Optimizer\.step#(AdamW|Adam)\.step$", exclude=aten("_fused_adamw_", "_fused_adam_"),
        anchor_op=r"^aten::(_foreach_addcdiv_|addcdiv_)$", anchor_arg=0, anchor_sum=True,
        # fused step per element: read param, grad, exp_avg, exp_avg_sq; write param, exp_avg, exp_avg_sq
        passes_forward=7.0, passes_backward=0.0,
        note="anchor = the parameters (first list of addcdiv_); when Kineto did not record the list shapes "
             "the agent infers them from the foreach kernels' time at the measured bandwidth",
    ),
    Remedy(
        kernel="sdpa", kind="existing",
        title="Replace attention written out with softmax by F.scaled_dot_product_attention (flash/cuDNN kernels)",
        apply="y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)",
        replaces="matmul → [scale] → [mask] → softmax → [dropout] → matmul",
        sequence=(
            Step(aten("matmul", "bmm")),
            Step(aten("mul", "div"), optional=True),
            Step(aten("masked_fill", "add", "where"), optional=True, gap=4),
            Step(aten("softmax", "_softmax"), gap=4),
            Step(aten("dropout"), optional=True),
            Step(aten("matmul", "bmm")),
        ),
        anchor_arg=0, passes_forward=4.0, passes_backward=8.0, keeps_flops=True,
        note="flash attention reads q, k, v and writes o (4 passes of q's size) forward; reads q, k, v, o, dO "
             "and writes dq, dk, dv (8) backward; it still does the two matmuls",
    ),
)

#: Existing fixes matched after the bundled kernels: detectors over the whole window.
_DETECTORS: Tuple[Remedy, ...] = (
    Remedy(
        kernel="torch_compile", kind="existing",
        title="Compile the model: torch.compile fuses chains of pointwise ops into single kernels",
        apply="model = torch.compile(model)",
        replaces="3 or more consecutive memory-bound pointwise ops",
        detector="pointwise_chain", anchor_arg=0, passes_forward=2.0, passes_backward=3.0,
        note="a fused chain is estimated to read its first input and write one output forward, and to move "
             "3 tensors of that size backward; the agent adds the drop-ins' ops Inductor fuses outside chains, "
             "and the drop-ins are then covered by it in the proposed set",
    ),
    Remedy(
        kernel="cuda_graphs", kind="existing",
        title="Launch-bound: capture the step with CUDA graphs (torch.compile mode='reduce-overhead')",
        apply='model = torch.compile(model, mode="reduce-overhead")',
        replaces="GPU idle gaps shorter than 200 µs in which the GPU waited for the next kernel's launch",
        detector="launch_bound", passes_forward=0.0, passes_backward=0.0,
    ),
    Remedy(
        kernel="bf16_autocast", kind="existing",
        title="Run fp32 matmuls in bf16 on tensor cores with autocast",
        apply='with torch.autocast("cuda", dtype=torch.bfloat16): loss = model(batch)',
        replaces="mm / addmm / bmm / conv / attention with fp32 inputs",
        detector="fp32_matmul", keeps_flops=True, passes_forward=0.0, passes_backward=0.0,
        note="replacement time = the larger of its FLOPs at the bf16 tensor peak and half its bytes at the bandwidth",
    ),
)



def remedies() -> Tuple[Remedy, ...]:
    """The table, in matching precedence (a matched op is claimed by the first entry only; detectors may
    overlap other entries: the agent counts each op once in the set it proposes): the existing fixes for fused
    optimizers and attention, then each bundled kernel's declared remedy in the order of the kernel list,
    then the detectors."""
    return _FIRST + tuple(kf.remedy for kf in all_facts() if kf.remedy is not None) + _DETECTORS


def __getattr__(name: str):
    """``REMEDIES`` (= :func:`remedies`) and ``BUNDLED_KERNELS`` (the Triton drop-ins this package ships),
    derived from the kernel list on each read."""
    if name == "REMEDIES":
        return remedies()
    if name == "BUNDLED_KERNELS":
        return frozenset(kernel_names())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: Detector parameters (documented in docs/analyze.md).
MIN_CHAIN = 3
MAX_LAUNCH_GAP_SECONDS = 200e-6

