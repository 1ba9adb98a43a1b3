"""Launch plumbing shared by every fused kernel in :mod:`mfuwatch.kernels`.

What lives here, and why it is shared:

* **Where a kernel runs.** :func:`use_triton` says whether a tensor goes to
  the Triton kernel (CUDA tensors, or CPU tensors when the Triton interpreter
  is on, ``TRITON_INTERPRET=1``, as in CI) or to the plain-PyTorch fallback
  (CPU tensors otherwise, so a patched model still runs on the CPU).
  :func:`device_guard` makes the tensor's GPU the current one for the launch:
  Triton launches on the current device's current stream, so a tensor on
  ``cuda:1`` while ``cuda:0`` is current would otherwise be read through the
  wrong context.
* **Row views.** :func:`as_rows` turns ``(..., N)`` into a ``(rows, N)``
  view plus its row stride, copying only when the last dimension is not
  contiguous or the leading dimensions cannot be merged into one stride (a
  transposed view, for example). The copy is the documented price of such
  inputs; the kernels never read a strided last dimension.
* **Launching.** :class:`Launcher` wraps a ``@triton.jit`` kernel. The
  first launch of each specialisation goes through Triton's own
  ``kernel[grid](...)``, which compiles (or loads from its cache) and returns
  the compiled kernel; later launches call that compiled kernel's launcher
  directly, skipping the argument binding and cache-key hashing that Triton
  redoes on every call (host time per launch: ``docs/kernels.md``).
* **Choosing launch settings.** :func:`tuned` times a short list of candidate
  settings once per (kernel, device, shape class) on the GPU with
  :func:`gpu_ms` (GPU time of back-to-back launches) and keeps the fastest. The
  first candidate is the heuristic default, used under the interpreter, during
  CUDA-graph capture, and when ``MFUWATCH_KERNELS_AUTOTUNE=0``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import statistics
import threading
import time
from typing import Any, Callable, Dict, Hashable, Optional, Sequence, Tuple

import torch
from torch.autograd import forward_ad as _forward_ad

#: True when Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``),
#: read once, as Triton itself does when it decorates the kernels.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")

_ON, _OFF = ("1", "true", "on", "yes"), ("0", "false", "off", "no")


def _version(mod: Any) -> Tuple[int, int]:
    """(major, minor) of a module's ``__version__``; (0, 0) when it cannot be read."""
    try:
        return tuple(int(p) for p in mod.__version__.split(".")[:2])  # type: ignore[return-value]
    except Exception:  # noqa: BLE001 - a missing or odd version string: treated as unknown
        return (0, 0)


def interpreter_index_fix() -> bool:
    """Let Triton <= 3.6's interpreter loop over runtime bounds under NumPy >= 2.4; True when applied.

    Triton's interpreter holds every scalar as a one-element NumPy array and,
    up to Triton 3.6, turns it into a Python int with ``int(array)``: a
    deprecation warning since NumPy 1.25 and a ``TypeError`` ("only
    0-dimensional arrays can be converted to Python scalars") since NumPy 2.4,
    raised by any ``for i in range(n)`` whose bound is a kernel argument. Triton
    3.7 squeezes the array first (``interpreter.py``, ``__index__`` of the
    patched tensor); this installs that same conversion on older Triton, only
    under ``TRITON_INTERPRET=1`` with NumPy >= 2.4, and changes nothing else.
    """
    if not INTERPRET:
        return False
    try:
        import numpy
        import triton
        import triton.runtime.interpreter as ti
    except Exception:  # noqa: BLE001 - no Triton or NumPy: nothing to fix
        return False
    if _version(triton) >= (3, 7) or _version(numpy) < (2, 4) or getattr(ti, "_mfuwatch_index_fix", False):
        return False
    original = getattr(ti, "_patch_lang_tensor", None)
    if original is None:
        return False

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    ti._patch_lang_tensor = patch_lang_tensor
    ti._mfuwatch_index_fix = True
    return True


interpreter_index_fix()


def first_order_only(backward: Callable) -> Callable:
    """Decorator for the ``backward`` of the fused ops' ``autograd.Function``: differentiable once, and a clear
    error when differentiated twice.

    The kernels have no second derivative. Like ``torch.autograd.function.once_differentiable``, the
    backward runs without grad mode and, when the caller asked for a graph (``create_graph=True``), its
    results are marked so that differentiating them raises "differentiate twice". Torch's decorator
    marks them only when an incoming gradient requires grad; ours also does when a saved input does
    (``x``, the weight). Without that, ``grad(y.sum(), x, create_graph=True)`` returned a gradient that
    silently counted as a constant in a later backward. The error node's graph edges also lead to
    the tensors it was marked for (the gradients and saved inputs that require grad): torch's node
    leads only to detached copies of the results, so a second ``torch.autograd.grad(..., inputs=[x])``
    (or ``backward(inputs=...)``), which runs only the nodes on a path to ``x``, skipped it and
    silently dropped the op's second-order term.
    """

    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        if not torch.is_grad_enabled():  # the usual backward (no create_graph): nothing more to do
            return backward(ctx, *grads)
        with torch.no_grad():
            outputs = backward(ctx, *grads)
        links = [t for t in (*grads, *ctx.saved_tensors) if t is not None and t.requires_grad]
        if not links:
            return outputs
        outs = outputs if isinstance(outputs, tuple) else (outputs,)
        err = torch._C._functions.DelayedError(
            b"mfuwatch.kernels: trying to differentiate twice an op whose fused kernels are differentiable once "
            b"(use the PyTorch op for higher-order gradients)", len(outs) + len(links))

        def marked(t):
            if t is None:
                return None
            t = t.detach()
            t.requires_grad = True
            return t
        # the error node's outputs alias its inputs: the first len(outs) are the results; the rest, aliases of
        # the links, are dropped (they exist so that the node has graph edges to the links)
        return tuple(err(*[marked(t) for t in outs], *links)[:len(outs)])

    return wrapper


def env_flag(name: str, default: bool) -> bool:
    """A boolean environment switch: 1/true/on/yes or 0/false/off/no (any case, spaces ignored).

    Unset or empty gives ``default``; any other value gives ``default`` too, with
    one warning naming the variable and the accepted values.
    """
    raw = os.environ.get(name, "").strip().lower()
    if raw in _ON:
        return True
    if raw in _OFF:
        return False
    if raw:
        import warnings

        warnings.warn(f"{name}={os.environ[name]!r} is not one of {'/'.join(_ON)} or {'/'.join(_OFF)}; "
                      f"using the default ({'on' if default else 'off'})", stacklevel=2)
    return default


#: Measure launch settings on first use (set ``MFUWATCH_KERNELS_AUTOTUNE=0`` to
#: keep the heuristic defaults, e.g. for bit-for-bit reproducible runs).
AUTOTUNE = env_flag("MFUWATCH_KERNELS_AUTOTUNE", True)

#: Launch compiled kernels directly (set ``MFUWATCH_KERNELS_FAST_LAUNCH=0`` to always go through Triton's
#: ``kernel[grid](...)``).
FAST_LAUNCH = env_flag("MFUWATCH_KERNELS_FAST_LAUNCH", True)

_TUNED: Dict[Hashable, Any] = {}
_TUNE_LOCK = threading.Lock()
_SM_COUNT: Dict[int, int] = {}


def use_triton(t: torch.Tensor) -> bool:
    """Whether ``t`` goes to the Triton kernel (True) or to the PyTorch fallback."""
    return t.is_cuda or (INTERPRET and t.device.type == "cpu")


def device_guard(t: torch.Tensor):
    """A context that makes ``t``'s CUDA device current (a no-op when it already is)."""
    if needs_device_switch(t):
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


#: The current CUDA device index (``torch._C._cuda_getDevice``: what ``torch.cuda.current_device()`` returns,
#: without its Python wrapper, about 1 µs less per call; the wrapper where the binding is missing).
_current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device


def needs_device_switch(t: torch.Tensor) -> bool:
    """Whether ``t`` is on a CUDA device other than the current one (one index comparison).

    The launchers call this on every launch and enter :func:`device_guard`'s
    context only when it is True, so the usual case costs no context manager.
    """
    if not t.is_cuda:
        return False
    return t.get_device() != _current_device()


def _triton_runtime_knobs():
    """``triton.knobs.runtime`` when this Triton's compiled kernels can be launched directly, else None.

    The direct call mirrors ``JITFunction.run`` of Triton 3.4 and later
    (``kernel.run(gx, gy, gz, stream, function, packed_metadata,
    launch_metadata, enter_hook, exit_hook, *all bound arguments)``, read from
    Triton 3.6's source); older Triton, the interpreter, or
    ``MFUWATCH_KERNELS_FAST_LAUNCH=0`` keep Triton's own launch path.
    """
    if INTERPRET or not FAST_LAUNCH:
        return None
    try:
        import triton

        if _version(triton) < (3, 4):
            return None
        return triton.knobs.runtime
    except Exception:  # noqa: BLE001 - no Triton, an unparsable version, no knobs: the plain path
        return None


def _direct_args(args: tuple) -> Tuple[tuple, list]:
    """``(specialisation key, launch arguments)`` of a launch's runtime arguments.

    The key holds, per argument, what Triton specialises it on: for a tensor its dtype and whether
    its data pointer is 16-byte aligned; for an int whether it equals 1, is divisible by 16, fits
    in int32; for a float nothing (fp32 arguments are not specialised); None and bools as they are.
    The launch arguments are ``args`` with each tensor replaced by its data pointer.

    Triton's compiled launcher takes an int as a device pointer as it is; a tensor costs it a Python
    ``data_ptr()`` call and a ``cuPointerGetAttribute`` driver call (Triton 3.6 and 3.9,
    ``backends/nvidia/driver``), and the pointer is read here anyway for the alignment. The key also
    records ``is_cuda``, so that a CPU tensor takes the JIT path, whose check raises Triton's "cannot be
    accessed from Triton (cpu tensor?)" instead of a launch on a host address.
    """
    key = []
    call = []
    for a in args:
        c = a.__class__
        if c is int:  # Triton's int classes: equal to 1, divisible by 16, fitting in int32
            key.append(1 if a == 1 else (2 if a % 16 == 0 else 3) if -0x80000000 <= a <= 0x7FFFFFFF
                       else (4 if a % 16 == 0 else 5))
            call.append(a)
        elif c is float:
            key.append(0)
            call.append(a)
        elif a is None or c is bool:
            key.append(a)
            call.append(a)
        else:
            p = a.data_ptr()
            key.append((a.dtype, p % 16 == 0, a.is_cuda))
            call.append(p)
    return tuple(key), call


def _hook_set(hook: Any) -> bool:
    """Whether a Triton launch hook is set: a callable, or a non-empty ``HookChain`` (Triton >= 3.5 keeps an
    empty chain, never None, when no hook is registered)."""
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return calls is None or len(calls) > 0


class Launcher:
    """Launches one ``@triton.jit`` kernel with little host time per call.

    ``Launcher(fn)(grid, args, consts, num_warps, maxnreg)`` runs ``fn[(grid,)](*args,
    **consts, num_warps=num_warps, maxnreg=maxnreg)``. ``args`` are the kernel's runtime
    arguments (tensors, ints, floats) in signature order; ``consts`` its
    ``tl.constexpr`` arguments, which must follow them in the signature, in
    signature order. ``maxnreg`` (optional) caps the registers per thread
    (Triton's CUDA option of that name, PTX ``.maxnreg``), so that more programs fit
    on an SM at the price of spills; None leaves the choice to the compiler.
    The interpreter ignores it.

    The first call for a given specialisation (device, ``num_warps``, ``maxnreg``, the
    constexpr values, and per argument what Triton specialises on: dtype and
    16-byte alignment of tensors; ints equal to 1, divisible by 16, or past
    int32) goes through Triton's JIT, which compiles or loads the kernel and
    returns it; the compiled kernel's launcher is kept and called directly by
    later calls with the same specialisation, with each tensor passed as its
    data pointer (see :func:`_direct_args`). Launch hooks (e.g. Triton's
    profiler, proton) are honoured by taking the JIT path while one is set.

    The tensors must be on the current CUDA device (the launchers switch
    devices before calling). Raises what Triton raises (compilation errors,
    out-of-resources) on the JIT path.
    """

    __slots__ = ("fn", "_cache", "_rt")

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self._cache: Dict[Hashable, Any] = {}
        self._rt = _triton_runtime_knobs()

    def __call__(self, grid: int, args: tuple, consts: Dict[str, Any], num_warps: int,
                 maxnreg: Optional[int] = None) -> None:
        rt = self._rt
        if rt is None or _hook_set(rt.launch_enter_hook) or _hook_set(rt.launch_exit_hook):
            self._jit(grid, args, consts, num_warps, maxnreg)
            return
        dev = _current_device()
        cvals = tuple(consts.values())
        akey, call = _direct_args(args)
        key = (dev, num_warps, maxnreg, cvals, akey)
        entry = self._cache.get(key)
        if entry is None:
            k = self._jit(grid, args, consts, num_warps, maxnreg)
            if hasattr(k, "result"):  # an asynchronous compile's future
                k = k.result()
            names = list(getattr(self.fn, "arg_names", ()))
            ok = names[len(args):] == list(consts)
            # only when the constexprs close the signature can they be appended after the runtime args
            self._cache[key] = (k.run, k.function, k.packed_metadata) if ok else False
            return
        if entry is False:
            self._jit(grid, args, consts, num_warps, maxnreg)
            return
        run, function, meta = entry
        run(grid, 1, 1, torch._C._cuda_getCurrentRawStream(dev), function, meta, None, None, None, *call, *cvals)

    def _jit(self, grid: int, args: tuple, consts: Dict[str, Any], num_warps: int, maxnreg: Optional[int]) -> Any:
        """Triton's own launch (compiles or loads on first use); returns what Triton returns."""
        if maxnreg is None:
            return self.fn[(grid,)](*args, **consts, num_warps=num_warps)
        return self.fn[(grid,)](*args, **consts, num_warps=num_warps, maxnreg=maxnreg)


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints (plain Python: ``triton.cdiv`` costs microseconds per call)."""
    return -(-a // b)


def as_rows(t: torch.Tensor, n: int) -> Tuple[torch.Tensor, int]:
    """View ``t`` of shape ``(..., n)``-compatible as ``(rows, n)``; return it and its row stride.

    The result's last dimension always has stride 1. The leading dimensions
    are merged without a copy when their strides allow it (any contiguous
    tensor, a slice ``x[..., :n]`` of a wider one, a broadcast along rows);
    otherwise the data is copied once with ``.contiguous()``.

    Raises:
        ValueError: ``t.numel()`` is not a multiple of ``n``.
    """
    if n <= 0 or t.numel() % n != 0:
        raise ValueError(f"cannot view a tensor of shape {tuple(t.shape)} as rows of {n} elements")
    if t.is_contiguous():  # the common case: one view, row stride n
        return t.view(-1, n), n
    if t.dim() >= 1 and t.shape[-1] == n and (t.stride(-1) == 1 or n == 1):
        try:
            v = t.view(-1, n)
        except RuntimeError:  # leading dims not mergeable into one stride
            v = t.reshape(-1, n).contiguous()
    else:
        v = t.reshape(-1, n)
        if v.stride(-1) != 1 and n > 1:
            v = v.contiguous()
    if v.shape[0] <= 1:
        return v, n  # a single row: any stride is as good as n
    return v, v.stride(0)


def kernel_rows(t: torch.Tensor, n: int) -> Tuple[torch.Tensor, int]:
    """What a row kernel is handed for ``t``: ``t`` itself with row stride ``n`` when contiguous, else :func:`as_rows`.

    The kernels address memory as ``pointer + row * stride + column`` and never
    look at a tensor's shape, so a contiguous tensor needs no ``(rows, n)`` view
    (a view costs about a microsecond of host time per tensor per call).
    Raises ValueError as :func:`as_rows` when ``t.numel()`` is not a multiple of ``n``.
    """
    if t.is_contiguous():
        if n <= 0 or t.numel() % n != 0:
            raise ValueError(f"cannot view a tensor of shape {tuple(t.shape)} as rows of {n} elements")
        return t, n
    return as_rows(t, n)


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached); 4 for the CPU/interpreter."""
    if device.type != "cuda":
        return 4
    idx = device.index if device.index is not None else torch.cuda.current_device()
    n = _SM_COUNT.get(idx)
    if n is None:
        n = torch.cuda.get_device_properties(idx).multi_processor_count
        _SM_COUNT[idx] = n
    return n


def row_bucket(rows: int) -> int:
    """Shape class of a row count for the tuning cache: the next power of two, capped at 2**17."""
    return 1 << min(17, max(0, rows - 1).bit_length())


#: Below this many elements a launch is dominated by its fixed cost: no timing, the default setting.
MIN_TUNE_ELEMENTS = 1 << 20


def tuned(kernel: str, device: torch.device, key: Hashable, candidates: Callable[[], Sequence[Any]],
          launch: Callable[[Any], Any], elements: int) -> Any:
    """Pick the fastest launch setting among ``candidates()`` for this kernel, device and key.

    ``candidates()`` lists the settings, the heuristic default first (called
    only on a cache miss). ``launch(candidate)`` must run the kernel with that
    setting and be idempotent (write the same outputs every time). Timing
    happens once per cache key on CUDA devices (:func:`gpu_ms`, a few tens of
    milliseconds per candidate); a candidate that fails
    to compile is skipped. Returns the first candidate without timing under the
    interpreter, on the CPU, during CUDA-graph capture, for launches of fewer
    than :data:`MIN_TUNE_ELEMENTS` elements (e.g. ``patch``'s probe), or when
    autotuning is off.
    """
    full_key = (kernel, device.index, key)
    best = _TUNED.get(full_key)
    if best is not None:
        return best
    cands = candidates()
    if len(cands) == 1 or not AUTOTUNE or device.type != "cuda" or elements < MIN_TUNE_ELEMENTS:
        return cands[0]
    if torch.cuda.is_current_stream_capturing():
        return cands[0]
    candidates = cands
    with _TUNE_LOCK:
        best = _TUNED.get(full_key)
        if best is not None:
            return best
        timings = []
        for cand in candidates:
            try:
                ms = gpu_ms(lambda: launch(cand))
            except Exception:  # e.g. out of registers/shared memory for this setting
                ms = float("inf")
            timings.append(ms)
        best = candidates[min(range(len(candidates)), key=timings.__getitem__)]
        _TUNED[full_key] = best
    return best


#: GPU clock used to turn a wait into ``torch.cuda._sleep`` cycles: above the H100/H200 boost clock (1.98 GHz,
#: NVIDIA H100/H200 datasheets), so that the wait lasts at least as long as asked on those GPUs.
_SLEEP_CYCLES_PER_S = 2.0e9


def gpu_ms(fn: Callable[[], Any], target_ms: float = 2.0, rounds: int = 3) -> float:
    """Median GPU milliseconds per call of ``fn`` (which launches work on the current stream), calls back to back.

    ``fn`` runs once to compile and warm up, once timed to size the loop, then ``rounds`` times
    ``k`` calls (``k`` so that a round takes about ``target_ms``, 3 to 200 calls) between two CUDA
    events. Each round starts behind a GPU wait (``torch.cuda._sleep``) longer than the host needs to
    enqueue its calls (up to 100 ms), so the events time the kernels alone, without the host's launch gaps, and
    each call finds what the previous one left in L2, as in CUDA-graph replay and in a training
    step, where a norm's input has just been written (``triton.testing.do_bench`` clears L2 and
    includes host time). Synchronises the device; raises what ``fn`` raises.
    """
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    fn()
    end.record()
    host_s = time.perf_counter() - t0
    end.synchronize()
    k = max(3, min(200, int(target_ms / max(start.elapsed_time(end), 1e-3))))
    sleep = getattr(torch.cuda, "_sleep", None)
    per_call = []
    for _ in range(rounds):
        if sleep is not None:  # twice the host's time for k calls, at least 50 µs, at most 100 ms
            sleep(int(min(max(2 * k * host_s, 50e-6), 0.1) * _SLEEP_CYCLES_PER_S))
        start.record()
        for _ in range(k):
            fn()
        end.record()
        end.synchronize()
        per_call.append(start.elapsed_time(end) / k)
    return statistics.median(per_call)


def tuned_settings() -> Dict[Hashable, Any]:
    """A copy of the launch settings chosen so far, keyed by (kernel, device index, shape key)."""
    return dict(_TUNED)


#: Under ``torch.compile``, hand Inductor the ops it fuses itself (norms, GLUs, rotary) as PyTorch ops instead of
#: the custom ops (``MFUWATCH_KERNELS_COMPILE_DECOMPOSE=0`` keeps the Triton kernels inside compiled graphs).
COMPILE_DECOMPOSE = env_flag("MFUWATCH_KERNELS_COMPILE_DECOMPOSE", True)


def compile_decomposes() -> bool:
    """Whether a fused op should be written out in PyTorch ops here: while ``torch.compile`` traces (and
    :data:`COMPILE_DECOMPOSE` is on).

    A custom op is opaque to Inductor, which then cannot fuse the op with its neighbours (the cast before a
    norm, the residual add, the projection's epilogue); the written-out form lets it, and computes as the
    kernels do (fp32 math, one rounding per output). ``FlopCounterMode`` and tensor subclasses outside
    ``torch.compile`` still take the custom ops (:func:`use_custom_op`).
    """
    return COMPILE_DECOMPOSE and torch.compiler.is_compiling()


def use_custom_op(*tensors) -> bool:
    """Whether a call must go through the registered ``torch.ops.mfuwatch`` op.

    True while ``torch.compile`` traces, while a ``TorchDispatchMode`` such as
    ``FlopCounterMode`` or ``FakeTensorMode`` is active, or when an input is a
    tensor subclass (DTensor, FakeTensor, ...); those need the dispatcher to
    see the op. Otherwise the eager fast path (a plain ``autograd.Function``,
    about 10-30 microseconds less Python per call) is taken: same launchers,
    same results.
    """
    if torch.compiler.is_compiling():
        return True
    if torch._C._len_torch_dispatch_stack() > 0:
        return True
    for t in tensors:
        if t is not None and type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:
            return True
    return False


def needs_grad(a: torch.Tensor, b: Optional[torch.Tensor] = None, c: Optional[torch.Tensor] = None) -> bool:
    """Whether a call records autograd history: grad mode on and an input that requires grad, or a forward-mode
    AD level open (``torch.autograd.forward_ad.dual_level``).

    When it does not (inference, ``torch.no_grad()``, evaluation, frozen inputs), the functionals call the
    launcher directly and skip the ``autograd.Function`` and its host time; the outputs are the same tensors
    either way. Under
    forward-mode AD they take the ``autograd.Function``, which raises PyTorch's "implement the jvp" error
    for a dual input: the direct launch would return a result without its tangent.
    """
    return (torch.is_grad_enabled() and (a.requires_grad or (b is not None and b.requires_grad)
                                         or (c is not None and c.requires_grad))) or _forward_ad._current_level >= 0


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


def pow2_at_least(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
