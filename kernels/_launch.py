"""Launch plumbing shared by every fused kernel in :mod:`mfuwatch.kernels`.

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

Choosing launch settings is :mod:`._tuning`'s; the autograd and custom-op dispatch :mod:`._dispatch`'s.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Hashable, Optional, Tuple

import torch

from ._env import INTERPRET, _version, env_flag

#: Launch compiled kernels directly (set ``MFUWATCH_KERNELS_FAST_LAUNCH=0`` to always go through Triton's
#: ``kernel[grid](...)``).
FAST_LAUNCH = env_flag("MFUWATCH_KERNELS_FAST_LAUNCH", True)

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


def pow2_at_least(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
