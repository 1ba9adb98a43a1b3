"""FLOPs and bytes of one profiled op, from the shapes ``torch.profiler(record_shapes=True)`` records.

A chrome-trace CPU op carries ``args["Input Dims"]`` (per input: a shape, a list of shapes
for a ``TensorList``, or ``[]``), ``args["Input type"]`` (``"c10::BFloat16"``, ``"float"``,
``"Scalar"``, ``"TensorList"``, ``""`` for ``None``) and ``args["Concrete Inputs"]`` (scalar
arguments as text). From these:

* **FLOPs** of matmul-like ops (``mm``, ``addmm``, ``bmm``, ``baddbmm``, ``_scaled_mm``,
  convolutions, the SDPA forward/backward variants) come from torch's own formulas in
  ``torch.utils.flop_counter`` (``flop_registry``, ``conv_flop_count``,
  ``sdpa_flop_count``, ``sdpa_backward_flop_count``), applied to the recorded shapes.
  torch is imported on first use only. Every other op gets an *elementwise estimate*:
  one FLOP per output element (per input element for reductions). That estimate only
  places pointwise/reduction ops on the roofline, where their intensity (≤ ~1 FLOP/B)
  is far below any GPU's machine balance (H200: ~14 FLOP/B on CUDA cores).
* **Bytes** = the sizes of the tensor inputs plus the outputs, at their dtype sizes. The
  trace has no output shapes, so outputs are inferred: matmul/attention/conv outputs by
  their shape rules; in-place ops (``name_``) write their first input; ``copy_`` reads its
  source and writes its destination; ``fill_``-like ops only write; reductions write the
  reduced shape (dims and keepdim from the concrete inputs); ``embedding``, ``gather``,
  ``index_select`` and ``nll_loss_forward`` read only the elements they select; everything else writes the broadcast shape of its tensor inputs at the
  first input's dtype (``_to_copy`` at the requested dtype). Tensors in a ``TensorList``
  carry no dtype in the trace and are counted at 4 bytes; a list whose shapes were not
  recorded (Kineto leaves long lists empty, e.g. ``_foreach_*`` over all parameters)
  counts as 0 bytes, and the op is then classified by name (see :mod:`.roofline`).
  Views (``view``, ``t``, ``transpose``, ``slice`` …) move nothing.

These are the bytes an op must move at least once, not cache-level traffic: the
approximation the roofline (Williams, Waterman & Patterson, CACM 2009) works with.
"""

from __future__ import annotations

import ast
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

#: Element size in bytes of each dtype spelling the profiler records in "Input type".
DTYPE_BYTES: Dict[str, int] = {
    "double": 8, "float": 4, "c10::Half": 2, "c10::BFloat16": 2,
    "c10::Float8_e4m3fn": 1, "c10::Float8_e5m2": 1, "c10::Float8_e4m3fnuz": 1, "c10::Float8_e5m2fnuz": 1,
    "long int": 8, "int": 4, "short int": 2, "signed char": 1, "unsigned char": 1, "bool": 1,
    "c10::complex<double>": 16, "c10::complex<float>": 8, "c10::complex<c10::Half>": 4,
}
#: Peak-table key (see ``mfuwatch.agent.device.peaks``) of each floating dtype spelling.
DTYPE_KEY: Dict[str, str] = {
    "double": "fp64", "float": "fp32", "c10::Half": "fp16", "c10::BFloat16": "bf16",
    "c10::Float8_e4m3fn": "fp8", "c10::Float8_e5m2": "fp8", "c10::Float8_e4m3fnuz": "fp8", "c10::Float8_e5m2fnuz": "fp8",
}
#: c10::ScalarType codes (``_to_copy``'s dtype argument as recorded) -> element bytes.
SCALAR_TYPE_BYTES = {0: 1, 1: 1, 2: 2, 3: 4, 4: 8, 5: 2, 6: 4, 7: 8, 8: 4, 9: 8, 10: 16, 11: 1, 15: 2,
                     23: 1, 24: 1, 25: 1, 26: 1}
_NON_TENSOR = ("Scalar", "ScalarList", "GenericList", "", None)

VIEW_OPS = frozenset(
    "aten::" + n for n in (
        "view", "_unsafe_view", "reshape", "_reshape_alias", "t", "transpose", "permute", "expand", "expand_as",
        "slice", "select", "narrow", "unsqueeze", "squeeze", "as_strided", "alias", "detach", "detach_",
        "split", "split_with_sizes", "chunk", "unbind", "view_as", "unflatten", "flatten", "numpy_T", "lift_fresh",
        "empty", "empty_like", "empty_strided", "resize_", "set_", "result_type", "is_nonzero", "item",
        "_local_scalar_dense", "to", "type_as", "contiguous", "clone_", "movedim", "diagonal", "real", "imag",
    ))
FILL_OPS = frozenset("aten::" + n for n in ("fill_", "zero_", "normal_", "uniform_", "random_", "bernoulli_",
                                            "exponential_", "ones", "zeros", "full", "arange", "randn", "rand"))
#: ops that read only the elements their index selects (bytes: those elements, the indices, the output)
GATHER_OPS = frozenset({"aten::embedding", "aten::gather", "aten::nll_loss_forward", "aten::index_select"})
REDUCTION_OPS = frozenset("aten::" + n for n in (
    "sum", "mean", "amax", "amin", "max", "min", "prod", "std", "var", "std_mean", "var_mean", "norm",
    "linalg_vector_norm", "any", "all", "argmax", "argmin", "logsumexp", "count_nonzero"))
SDPA_FORWARD = frozenset("aten::" + n for n in (
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_flash_attention_forward", "_efficient_attention_forward",
    "_cudnn_attention_forward", "_scaled_dot_product_flash_attention_for_cpu"))
SDPA_BACKWARD = frozenset("aten::" + n for n in (
    "_scaled_dot_product_flash_attention_backward", "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_cudnn_attention_backward", "_flash_attention_backward", "_efficient_attention_backward",
    "_cudnn_attention_backward", "_scaled_dot_product_flash_attention_for_cpu_backward"))
# position of (stride, padding, dilation) in each convolution op's arguments
CONV_ARGS = {"aten::convolution": (3, 4, 5), "aten::_convolution": (3, 4, 5), "aten::convolution_overrideable": (3, 4, 5),
             "aten::cudnn_convolution": (3, 2, 4), "aten::mkldnn_convolution": (4, 3, 5),
             "aten::_slow_conv2d_forward": (4, 5, None)}
GROUPED_MM = frozenset({"aten::_grouped_mm", "aten::_scaled_grouped_mm"})  # MoE experts (transformers 5)
MATMUL_OPS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_mm",
                        "aten::convolution_backward"}) | SDPA_FORWARD | SDPA_BACKWARD | frozenset(CONV_ARGS) | GROUPED_MM


@dataclass(frozen=True)
class OpCost:
    """What one call of an op computes and moves.

    ``flops``: FLOP (multiply and add counted separately). ``bytes``: bytes read + written.
    ``dtype``: peak-table key of the first floating tensor input ("bf16", "fp32", ...) or None.
    ``matmul``: the op runs on tensor cores when its dtype has them (matmul, conv, attention).
    ``exact_flops``: FLOPs came from torch's formula, not the elementwise estimate.
    """

    flops: float
    bytes: float
    dtype: Optional[str]
    matmul: bool
    exact_flops: bool

    @property
    def intensity(self) -> Optional[float]:
        """Arithmetic intensity in FLOP/byte, or None when no bytes are known."""
        return self.flops / self.bytes if self.bytes > 0 else None


#: Set by :func:`import_formulas_without_triton` (the ``mfuwatch analyze`` process only).
_WITHOUT_TRITON = False


def import_formulas_without_triton() -> None:
    """Import torch's FLOP formulas without Triton, in a process that only reads traces (``mfuwatch analyze``).

    ``torch.utils.flop_counter`` imports ``triton.runtime.jit`` at import time (to count Triton kernels a
    ``FlopCounterMode`` meets), which costs about 75 MB of resident memory here (292 MB for the import
    against 225 MB for ``import torch``, ``benchmarks/big_trace.py``); the formulas applied to recorded
    shapes never need it. After this call, the first use imports ``flop_counter`` with ``triton`` hidden
    from the import system, unless triton or ``flop_counter`` is already imported (then nothing changes).
    Not for a training process: there ``flop_counter`` would keep counting Triton kernels as nothing.
    """
    global _WITHOUT_TRITON
    _WITHOUT_TRITON = True


def _import_flop_counter() -> Any:
    import sys

    if not _WITHOUT_TRITON or "triton" in sys.modules or "torch.utils.flop_counter" in sys.modules:
        from torch.utils import flop_counter

        return flop_counter
    import logging

    quiet = logging.getLogger("torch.utils.flop_counter")  # "triton not found" on a CUDA build of torch
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    sys.modules["triton"] = None  # type: ignore[assignment]  # "import triton" raises ImportError
    try:
        from torch.utils import flop_counter
    finally:
        del sys.modules["triton"]
        quiet.setLevel(level)
    return flop_counter


@lru_cache(maxsize=1)
def _torch_formulas() -> Tuple[Dict[str, Tuple[Callable, Optional[int]]], Any]:
    """``{"aten::mm": (formula, positional arity or None), ...}`` from ``torch.utils.flop_counter.flop_registry`` (imports torch once)."""
    try:
        flop_counter = _import_flop_counter()
    except Exception:  # noqa: BLE001 - without torch every op gets the elementwise estimate
        return {}, None
    import inspect

    table = {}
    for key, fn in flop_counter.flop_registry.items():
        name = getattr(key, "_qualified_op_name", None)
        if not name:
            continue
        try:  # how many positional shapes/values the formula takes (some have no *args)
            params = list(inspect.signature(fn).parameters.values())
            n = None if any(p.kind is p.VAR_POSITIONAL for p in params) else sum(
                1 for p in params if p.kind is p.POSITIONAL_OR_KEYWORD and p.name != "out_shape")
        except (TypeError, ValueError):
            n = None
        table[name] = (fn, n)
    return table, flop_counter


def _literal(text: Any) -> Any:
    if not isinstance(text, str) or not text:
        return None
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return {"true": True, "false": False}.get(text.lower())


def _numel(shape: Sequence[int]) -> int:
    return math.prod(int(d) for d in shape) if shape else 1


def _broadcast(shapes: List[Tuple[int, ...]]) -> Optional[Tuple[int, ...]]:
    n = max(len(s) for s in shapes)
    out = []
    for i in range(1, n + 1):
        dims = {s[-i] for s in shapes if len(s) >= i and s[-i] != 1}
        if len(dims) > 1:
            return None
        out.append(dims.pop() if dims else 1)
    return tuple(reversed(out))


def _conv_out(x: Sequence[int], w: Sequence[int], stride: Any, padding: Any, dilation: Any) -> Tuple[int, ...]:
    k = len(x) - 2
    def per_dim(v: Any, default: int) -> List[int]:
        if v is None:
            return [default] * k
        v = list(v) if isinstance(v, (list, tuple)) else [v]
        return (v * k)[:k] if len(v) == 1 else v
    s, p, d = per_dim(stride, 1), per_dim(padding, 0), per_dim(dilation, 1)
    spatial = [(x[2 + i] + 2 * p[i] - d[i] * (w[2 + i] - 1) - 1) // s[i] + 1 for i in range(k)]
    return (x[0], w[0], *spatial)


def op_cost(name: str, dims: Optional[list], types: Optional[list], concrete: Optional[list]) -> OpCost:
    """FLOPs and bytes of one op call from its recorded ``Input Dims``/``Input type``/``Concrete Inputs``.

    Never raises: a shape a formula cannot handle falls back to the elementwise estimate.
    """
    dims, types, concrete = dims or [], types or [], concrete or []
    if name in VIEW_OPS:
        return OpCost(0.0, 0.0, None, False, False)
    args: List[Any] = []  # what torch's formulas take: shapes for tensors, values for scalars
    tensors: List[Tuple[Tuple[int, ...], int]] = []  # (shape, itemsize) of tensor inputs, in order
    list_bytes = 0
    dtype = None
    first_item = None
    for i, t in enumerate(types):
        d = dims[i] if i < len(dims) else []
        if t == "TensorList":
            shapes = [tuple(s) for s in d if isinstance(s, list)]
            list_bytes += sum(_numel(s) for s in shapes) * 4
            args.append(shapes)
        elif t in _NON_TENSOR:
            args.append(_literal(concrete[i]) if i < len(concrete) else None)
        else:
            shape = tuple(int(x) for x in d) if isinstance(d, list) else ()
            size = DTYPE_BYTES.get(t, 4)
            tensors.append((shape, size))
            args.append(shape)
            if dtype is None and t in DTYPE_KEY:
                dtype = DTYPE_KEY[t]
            if first_item is None:
                first_item = size
    in_bytes = sum(_numel(s) * b for s, b in tensors) + list_bytes
    out_shape, out_item, out_bytes = None, first_item or 4, None
    try:
        out_shape, out_bytes = _output(name, args, tensors, concrete, list_bytes)
    except (IndexError, TypeError, ValueError):
        out_shape = None
    if out_bytes is None:
        if out_shape is None and tensors:
            shapes = [s for s, _ in tensors]
            out_shape = _broadcast(shapes) or max(shapes, key=_numel)
        if name == "aten::_to_copy" and len(concrete) > 1:
            out_item = SCALAR_TYPE_BYTES.get(_literal(concrete[1]), out_item)
        out_bytes = _numel(out_shape) * out_item if out_shape is not None else list_bytes
    if name == "aten::copy_" and len(tensors) >= 2:
        total = _numel(tensors[0][0]) * tensors[0][1] + _numel(tensors[1][0]) * tensors[1][1]
    elif name in FILL_OPS:
        total = out_bytes
    elif name in GATHER_OPS and len(tensors) >= 2:
        total = 2 * out_bytes + _numel(tensors[1][0]) * tensors[1][1]  # gathered elements, indices, output
    else:
        total = in_bytes + out_bytes
    flops, exact = _flops(name, args, out_shape), True
    if flops is None:
        exact = False
        big = max((_numel(s) for s, _ in tensors), default=0)
        elements = _numel(out_shape) if out_shape is not None else 0
        flops = float(big if name in REDUCTION_OPS else elements)
    return OpCost(float(flops), float(total), dtype, name in MATMUL_OPS, exact)


def _output(name: str, args: list, tensors: list, concrete: list, list_bytes: int):
    """(output shape, output bytes or None to derive from the shape) for ops with a known rule."""
    item = tensors[0][1] if tensors else 4
    if name == "aten::mm" or name == "aten::_scaled_mm":
        return (args[0][0], args[1][1]), None
    if name == "aten::addmm":
        return (args[1][0], args[2][1]), None
    if name == "aten::bmm":
        return (args[0][0], args[0][1], args[1][2]), None
    if name == "aten::baddbmm":
        return (args[1][0], args[1][1], args[2][2]), None
    if name in SDPA_FORWARD:
        q, v = args[0], args[2]
        return (*q[:-1], v[-1]), None
    if name in SDPA_BACKWARD:
        return None, sum(_numel(s) * b for s, b in tensors[1:4])
    if name in CONV_ARGS:
        si, pi, di = CONV_ARGS[name]
        return _conv_out(args[0], args[1], args[si], args[pi], args[di] if di is not None else None), None
    if name == "aten::convolution_backward":
        return None, sum(_numel(s) * b for s, b in tensors[1:3])
    if name.startswith("aten::_foreach_"):
        per_list = list_bytes / max(1, sum(1 for a in args if isinstance(a, list)))
        return None, per_list  # in place: first list rewritten; out of place: one new list
    if name.endswith("_") and not name.endswith("__") and tensors:
        return tensors[0][0], None
    if name in REDUCTION_OPS and tensors:
        shape = list(tensors[0][0])
        red = args[1] if len(args) > 1 else None
        keep = bool(args[2]) if len(args) > 2 and isinstance(args[2], bool) else False
        if isinstance(red, int) and not isinstance(red, bool):
            red = [red]
        if not isinstance(red, list) or not red:
            return ((1,) * len(shape) if keep else ()), None
        red = {r % len(shape) for r in red} if shape else set()
        return tuple(1 if i in red else d for i, d in enumerate(shape) if keep or i not in red), None
    if name == "aten::embedding" and len(tensors) >= 2:
        return (*tensors[1][0], *tensors[0][0][1:]), _numel((*tensors[1][0], *tensors[0][0][1:])) * item
    if name == "aten::gather" and len(tensors) >= 2:
        return tensors[1][0], _numel(tensors[1][0]) * item
    if name == "aten::nll_loss_forward" and len(tensors) >= 2:
        return None, _numel(tensors[1][0]) * item  # one log-probability per target
    if name == "aten::index_select" and len(tensors) >= 2 and isinstance(args[1], int):
        shape = list(tensors[0][0])
        shape[args[1] % len(shape)] = _numel(tensors[1][0])
        return tuple(shape), None
    if name == "aten::cat" and list_bytes:
        return None, list_bytes
    return None, None


#: position of the two matrix operands in each dense matmul op's arguments
_DENSE_OPERANDS = {"aten::mm": (0, 1), "aten::addmm": (1, 2), "aten::bmm": (0, 1), "aten::baddbmm": (1, 2),
                   "aten::_scaled_mm": (0, 1)}


def _dense_matmul_flops(name: str, args: list) -> Optional[float]:
    """``2·M·K·N`` (times the batch for ``bmm``/``baddbmm``) from the recorded operand shapes.

    The same count as ``torch.utils.flop_counter`` (one multiply and one add per term), written
    here so ``mfuwatch analyze`` of a transformer trace needs no torch import (its import alone
    costs about 380 MB). Returns None for other ops or shapes that do not fit (the caller falls
    back to torch's formula).
    """
    pos = _DENSE_OPERANDS.get(name)
    if pos is None or len(args) <= max(pos):
        return None
    a, b = args[pos[0]], args[pos[1]]
    if not (isinstance(a, (list, tuple)) and isinstance(b, (list, tuple))) or len(a) != len(b) or len(a) not in (2, 3):
        return None
    if not all(isinstance(d, int) for d in (*a, *b)) or a[-1] != b[-2]:
        return None
    batch = a[0] if len(a) == 3 else 1
    return 2.0 * batch * a[-2] * a[-1] * b[-1]


def _flops(name: str, args: list, out_shape: Optional[Tuple[int, ...]]) -> Optional[float]:
    """torch's FLOP formula for ``name`` on these shapes, or None when torch has none (or it fails)."""
    if name not in MATMUL_OPS:
        return None
    if name in SDPA_FORWARD or name in SDPA_BACKWARD or name in GROUPED_MM:
        # our formulas: the same on every torch version (2.11's reject grouped-query shapes)
        from mfuwatch.agent.flops.op_flops import trace_op_flops

        return trace_op_flops(name, args, out_shape)
    dense = _dense_matmul_flops(name, args)
    if dense is not None:
        return dense
    table, fc = _torch_formulas()  # convolutions: torch's formulas (imports torch on the first one)
    if fc is None:
        return None
    try:
        if name in CONV_ARGS:
            return float(fc.conv_flop_count(args[0], args[1], out_shape, transposed=False))
        if name in SDPA_FORWARD and name not in table:
            return float(fc.sdpa_flop_count(args[0], args[1], args[2]))
        if name in SDPA_BACKWARD and name not in table:
            return float(fc.sdpa_backward_flop_count(args[0], args[1], args[2], args[3]))
        entry = table.get(name)
        if entry is None:
            return None
        fn, n = entry
        args = args if n is None else args[:n]
        if name == "aten::convolution_backward":
            return float(fn(*args, out_val=(args[1], args[2], None)))
        return float(fn(*args, out_val=out_shape))
    except Exception:  # noqa: BLE001 - an unusual call shape must not break the window
        return None
