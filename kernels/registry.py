"""The suggestions registry: which profiled op patterns have which remedy, and what the remedy must move.

The agent (``mfuwatch.agent.suggest``) matches these entries against a profiler window
and turns each match into a :class:`mfuwatch.agent.schema.Suggestion` with an expected
gain. This module is plain data: it imports neither torch, triton nor anything from
``mfuwatch.agent``, so reading it is free.

Each :class:`Remedy` is either

* ``kind="existing"``: a feature torch already has (``fused=True`` optimizers, SDPA,
  ``torch.compile``, CUDA graphs, bf16 autocast). Ranked before any custom kernel: the
  field's discipline is to reach for the maintained fix first;
* ``kind="bundled"``: a Triton drop-in in :mod:`mfuwatch.kernels`, applied with
  ``mfuwatch.kernels.patch(model, kernels=[...])``. Only names in :data:`BUNDLED_KERNELS`
  (= ``mfuwatch.kernels.AVAILABLE_KERNELS``) may be bundled (a bundled entry naming anything
  else raises at import); remedies for ops without a bundled kernel point to an existing fix and
  say so in their title.

How an entry finds its ops (first that applies):

* ``sequence``: consecutive *top-level* forward ops of one thread that launched work
  (views skipped), e.g. ``pow → mean → add → rsqrt → mul`` for an RMSNorm written out in
  PyTorch. Each :class:`Step` lists accepted op names; ``optional`` steps may be absent;
  ``gap`` lets that many unrelated ops sit before the step (they are not counted: in
  ``silu(gate(x)) * up(x)`` the ``up`` matmul runs between ``silu`` and ``mul``); with
  ``claim=False`` a step is matched but its time is not the remedy's. The backward ops
  autograd ran for the claimed ops (same ``Sequence number``) are claimed too.
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
:func:`mfuwatch.kernels.traffic.minimal_bytes` of the anchor's ``rows × hidden`` shape
(forward, plus backward when backward ops were claimed): the same count the kernels'
own benchmarks use. For an existing fix they are ``passes_forward (+ passes_backward)
× anchor bytes``, a pass being one read or one write of the anchor tensor, counted by
writing out what the fused replacement reads and writes. ``keeps_flops`` marks
replacements that still do the matched ops' FLOPs (attention), whose time is at least
FLOPs / peak.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from . import AVAILABLE_KERNELS, traffic  # both plain Python: the package imports torch/triton lazily

#: The Triton drop-ins this package ships; a ``kind="bundled"`` entry must name one of them.
BUNDLED_KERNELS = frozenset(AVAILABLE_KERNELS)


def _ops(*names: str) -> Tuple[str, ...]:
    return tuple("aten::" + n for n in names)


@dataclass(frozen=True)
class Step:
    """One element of a :attr:`Remedy.sequence`: an op whose name is in ``ops``."""

    ops: Tuple[str, ...]
    optional: bool = False
    gap: int = 0  # unrelated top-level ops allowed before this step (not claimed)
    claim: bool = True


@dataclass(frozen=True)
class Remedy:
    """A remedy for a profiled op pattern (see the module docstring for every field's meaning)."""

    kernel: str  # short id; the Suggestion's ``kernel`` and the metric label
    title: str
    kind: str  # "existing" | "bundled"
    apply: str  # the one line that applies it
    replaces: str  # the op pattern in words, for docs and tables
    sequence: Tuple[Step, ...] = ()
    region: Optional[str] = None  # regex on a user_annotation name
    exclude: Tuple[str, ...] = ()  # ops that show the remedy is already in use
    detector: Optional[str] = None
    anchor_op: Optional[str] = None
    anchor_arg: int = 0
    anchor_sum: bool = False
    passes_forward: float = 2.0
    passes_backward: float = 3.0
    keeps_flops: bool = False
    note: str = ""

    def __post_init__(self) -> None:
        if self.kind not in ("existing", "bundled"):
            raise ValueError(f"Remedy {self.kernel!r}: kind must be 'existing' or 'bundled', got {self.kind!r}")
        if self.kind == "bundled" and self.kernel not in BUNDLED_KERNELS:
            raise ValueError(f"Remedy {self.kernel!r} is marked bundled but mfuwatch.kernels.AVAILABLE_KERNELS "
                             f"has only {sorted(BUNDLED_KERNELS)}")

    @property
    def bundled(self) -> bool:
        """True when the remedy is a Triton kernel shipped in :mod:`mfuwatch.kernels`."""
        return self.kind == "bundled"

    def minimal_bytes(self, numel: int, hidden: int, itemsize: int, *, backward: bool) -> float:
        """Bytes the replacement must move for an anchor of ``numel`` elements (last dim ``hidden``)
        of ``itemsize`` bytes, forward plus backward when ``backward``.

        Bundled kernels: :func:`mfuwatch.kernels.traffic.minimal_bytes` (rows = numel / hidden).
        Existing fixes: ``(passes_forward + passes_backward) × numel × itemsize``.
        """
        if self.bundled:
            rows, hidden = (numel // hidden, hidden) if hidden > 0 else (numel, 1)
            total = traffic.minimal_bytes(self.kernel, rows, hidden, itemsize)
            if backward:
                total += traffic.minimal_bytes(self.kernel, rows, hidden, itemsize, backward=True)
            return float(total)
        return (self.passes_forward + (self.passes_backward if backward else 0.0)) * numel * itemsize


def _patch(kernel: str) -> str:
    return f'mfuwatch.kernels.patch(model, kernels=["{kernel}"])'


_RMS_CORE = (
    Step(_ops("to", "_to_copy"), optional=True),  # x.float()
    Step(_ops("pow", "square")),
    Step(_ops("mean")),
    Step(_ops("add", "add_")),
    Step(_ops("rsqrt")),
    Step(_ops("mul")),
    Step(_ops("type_as", "to", "_to_copy"), optional=True),  # .type_as(x) / .to(input_dtype)
    Step(_ops("mul"), optional=True),  # * weight
)

#: The registry, in matching precedence (a matched op is claimed by the first entry only;
#: detectors may overlap other entries: the agent counts each op once in the set it proposes).
REGISTRY: Tuple[Remedy, ...] = (
    Remedy(
        kernel="fused_adamw", kind="existing",
        title="Use the fused AdamW/Adam step (one kernel per parameter group instead of ~10 foreach kernels)",
        apply="optimizer = torch.optim.AdamW(model.parameters(), lr=lr, fused=True)",
        replaces="Optimizer.step#Adam(W).step: _foreach_* / multi_tensor_apply kernels",
        region=r"^Optimizer\.step#(AdamW|Adam)\.step$", exclude=_ops("_fused_adamw_", "_fused_adam_"),
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
            Step(_ops("matmul", "bmm")),
            Step(_ops("mul", "div"), optional=True),
            Step(_ops("masked_fill", "add", "where"), optional=True, gap=4),
            Step(_ops("softmax", "_softmax"), gap=4),
            Step(_ops("dropout"), optional=True),
            Step(_ops("matmul", "bmm")),
        ),
        anchor_arg=0, passes_forward=4.0, passes_backward=8.0, keeps_flops=True,
        note="flash attention reads q, k, v and writes o (4 passes of q's size) forward; reads q, k, v, o, dO "
             "and writes dq, dk, dv (8) backward; it still does the two matmuls",
    ),
    Remedy(
        kernel="cross_entropy", kind="bundled",
        title="Fused cross-entropy (Triton drop-in): a Hugging Face causal LM's head + loss in chunks without "
              "the full logits (linear_cross_entropy); elsewhere mfuwatch.kernels.cross_entropy(logits, targets)",
        apply=_patch("cross_entropy"),
        replaces="[logits.float()] → log_softmax → nll_loss, or cross_entropy_loss",
        # gap: Hugging Face's ForCausalLMLoss pads and copies the labels between logits.float() and the loss
        sequence=(Step(_ops("to", "_to_copy"), optional=True),
                  Step(_ops("cross_entropy_loss", "log_softmax", "_log_softmax"), gap=3),
                  Step(_ops("nll_loss", "nll_loss_nd"), optional=True)),
        anchor_arg=0,
        note="bytes from mfuwatch.kernels.traffic: forward reads the logits, backward reads them again and "
             "writes dlogits (the fused forward forms the gradient while the row is in cache). For model code "
             "outside the recognised families: loss = mfuwatch.kernels.cross_entropy(logits, targets), or "
             "mfuwatch.kernels.linear_cross_entropy(hidden, lm_head.weight, targets) to skip the logits; "
             "under torch.compile, compiling F.cross_entropy fuses the same ops",
    ),
    Remedy(
        kernel="rotary", kind="bundled",
        title="Fused rotary embedding (Triton drop-in) instead of rotate_half written out as mul, neg, cat, mul, add",
        apply=_patch("rotary"),
        replaces="x * cos + cat(-x2, x1) * sin (Hugging Face apply_rotary_pos_emb, once for q and once for k)",
        sequence=(Step(_ops("mul")), Step(_ops("neg")), Step(_ops("cat")), Step(_ops("mul")), Step(_ops("add"))),
        anchor_arg=0,
        note="anchor = q or k (B, H, T, D); bytes from mfuwatch.kernels.traffic: forward reads x and writes "
             "x_embed, backward reads the gradient and writes dx (cos/sin, shared by all heads, left out)",
    ),
    Remedy(
        kernel="rms_norm", kind="bundled",
        title="Fused RMSNorm (Triton drop-in) instead of RMSNorm written out as pow/mean/rsqrt/mul",
        apply=_patch("rms_norm"),
        replaces="[to] → pow → mean → add → rsqrt → mul → [type_as] → [mul weight]",
        sequence=_RMS_CORE, anchor_arg=0,
        note="bytes from mfuwatch.kernels.traffic: forward reads x, w and writes y; backward reads x, dy, w "
             "and writes dx, dw",
    ),
    Remedy(
        kernel="layer_norm", kind="bundled",
        title="Fused LayerNorm (Triton drop-in) for aten::native_layer_norm",
        apply=_patch("layer_norm"),
        replaces="layer_norm / native_layer_norm",
        sequence=(Step(_ops("layer_norm", "native_layer_norm")),), anchor_arg=0,
    ),
    Remedy(
        kernel="swiglu", kind="bundled",
        title="Fused SwiGLU (Triton drop-in): silu(gate) * up in one kernel",
        apply=_patch("swiglu"),
        replaces="silu → [up projection] → mul",
        sequence=(Step(_ops("silu")), Step(_ops("mul"), gap=2)), anchor_arg=0,
        note="bytes from mfuwatch.kernels.traffic: forward reads gate and up, writes h; backward reads dh, "
             "gate, up and writes dgate, dup",
    ),
    Remedy(
        kernel="geglu", kind="bundled",
        title="Fused GEGLU (Triton drop-in): gelu(gate) * up in one kernel",
        apply=_patch("geglu"),
        replaces="gelu → [up projection] → mul",
        sequence=(Step(_ops("gelu")), Step(_ops("mul"), gap=2)), anchor_arg=0,
    ),
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

#: Detector parameters (documented in docs/analyze.md).
MIN_CHAIN = 3
MAX_LAUNCH_GAP_SECONDS = 200e-6

