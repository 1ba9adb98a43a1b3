"""Peak FLOP/s and memory bandwidth of one GPU: the MFU denominator and the roofline's machine balance.

The numbers live in ``agent/data/gpus.yaml``, one row per product, each row citing its
datasheet; tensor rates are dense (no 2:4 sparsity). :func:`resolve_peaks` is the one
resolver: the agent (MFU), the profiler window (in its child process) and ``mfuwatch
analyze`` all get their :class:`Peaks` from it. A GPU is found by its NVML PCI device id
where the row lists one, else by its name (:func:`lookup`); a GPU missing from the table
gets no peak, and one warning that names it and says how to pass ``peak_flops`` or
``calibrate=True``: the agent never borrows another GPU's numbers.

:mod:`mfuwatch.agent.device.calibrate` measures instead of looking up (``calibrate=True``, the CPU
demo, profiler windows without a table row). Usage::

    from mfuwatch.agent.device import peaks
    p = peaks.resolve_peaks(name="NVIDIA H200", pci_device_id=0x233510DE)  # the H200 SXM row
    key = peaks.training_dtype_key(torch.float32, torch.bfloat16, peaks.torch_allows_tf32())
    flops, source = peaks.mfu_peak(p, key)                                   # 989.4e12 for bf16

This module imports torch only inside the functions that need it.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import warnings
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import yaml

log = logging.getLogger(__name__)

#: The dtype keys of every row, in the order of the YAML file.
DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8")
#: The keys a :class:`Peaks` may hold: the table's, and "fp64" (given by flags; the table has no fp64 column).
PEAK_KEYS = DTYPES + ("fp64",)
TABLE_PATH = Path(__file__).resolve().parent.parent / "data" / "gpus.yaml"
_NVIDIA_VENDOR_ID = 0x10DE
_warned: set = set()  # (kind, name) pairs already warned about, so each warning appears once


@dataclass(frozen=True)
class GpuSpec:
    """One row of the peak table, in base units.

    ``peak_flops`` maps each of :data:`DTYPES` to dense FLOP/s (``fp32`` = CUDA cores,
    the others tensor cores) or ``None`` where the hardware has no such unit (FP8 on
    Ampere). ``pci_device_ids`` are 16-bit PCI device ids (NVML ``pciDeviceId >> 16``).
    """

    name: str
    aliases: List[str]
    pci_device_ids: List[int]
    peak_flops: Dict[str, Optional[float]]
    memory_bandwidth_bytes_per_second: float
    source: str


def _tokens(name: str) -> List[str]:
    """Lower-case alphanumeric words of a GPU name, without the vendor word."""
    words = re.split(r"[^0-9a-z]+", name.lower())
    return [w for w in words if w and w not in ("nvidia", "tesla")]


def _alias_word_sets(spec: GpuSpec) -> List[frozenset]:
    return [frozenset(_tokens(a)) for a in (spec.name, *spec.aliases) if _tokens(a)]


def load_table(path: Optional[Path] = None) -> Tuple[GpuSpec, ...]:
    """Read and validate a GPU table (default: the bundled ``gpus.yaml``).

    Raises ValueError naming the row and the field when a row lacks a source, a dtype,
    a positive bandwidth, or has a non-integer PCI id.
    """
    return _load_table(str(path or TABLE_PATH))


@lru_cache(maxsize=8)
def _load_table(path: str) -> Tuple[GpuSpec, ...]:
    with open(path, encoding="utf-8") as f:
        doc = yaml.safe_load(f)
    rows = doc.get("gpus") if isinstance(doc, dict) else None
    if not isinstance(rows, list) or not rows:
        raise ValueError(f"{path}: expected a non-empty list under 'gpus'")
    specs = []
    for i, row in enumerate(rows):
        where = f"{path}: gpus[{i}] ({row.get('name', '?') if isinstance(row, dict) else '?'})"
        if not isinstance(row, dict) or not row.get("name"):
            raise ValueError(f"{where}: field 'name' is missing")
        if not str(row.get("source", "")).strip():
            raise ValueError(f"{where}: field 'source' is empty; every row cites its datasheet")
        tflops = row.get("peak_tflops") or {}
        missing = [k for k in DTYPES if k not in tflops]
        if missing:
            raise ValueError(f"{where}: field 'peak_tflops' lacks {missing}; need all of {DTYPES}")
        peak = {}
        for k in DTYPES:
            v = tflops[k]
            if v is not None and not (isinstance(v, (int, float)) and v > 0):
                raise ValueError(f"{where}: peak_tflops.{k} must be a positive number or null, got {v!r}")
            peak[k] = None if v is None else float(v) * 1e12
        if peak["fp32"] is None or peak["bf16"] is None:
            raise ValueError(f"{where}: peak_tflops.fp32 and .bf16 may not be null")
        bw = row.get("memory_bandwidth_tb_per_second")
        if not (isinstance(bw, (int, float)) and bw > 0):
            raise ValueError(f"{where}: field 'memory_bandwidth_tb_per_second' must be > 0, got {bw!r}")
        ids = row.get("pci_device_ids") or []
        if not all(isinstance(x, int) and 0 < x <= 0xFFFF for x in ids):
            raise ValueError(f"{where}: field 'pci_device_ids' must hold 16-bit integers, got {ids!r}")
        specs.append(GpuSpec(name=str(row["name"]), aliases=[str(a) for a in row.get("aliases") or []],
                             pci_device_ids=list(ids), peak_flops=peak,
                             memory_bandwidth_bytes_per_second=float(bw) * 1e12,
                             source=" ".join(str(row["source"]).split())))
    return tuple(specs)


def _device_id16(pci_device_id: int) -> Optional[int]:
    """Accept NVML's 32-bit ``pciDeviceId`` (device << 16 | vendor) or a bare 16-bit id."""
    if pci_device_id > 0xFFFF:
        if pci_device_id & 0xFFFF != _NVIDIA_VENDOR_ID:
            return None
        return pci_device_id >> 16
    return pci_device_id


def lookup(name: Optional[str] = None, pci_device_id: Optional[int] = None,
           *, table: Optional[Sequence[GpuSpec]] = None) -> Optional[GpuSpec]:
    """Find the row of a GPU: by PCI device id first, else by name; ``None`` when unknown.

    Name matching: the name and every alias are split into lower-case words (``"NVIDIA
    A100-SXM4-80GB"`` -> ``{a100, sxm4, 80gb}``); a row matches when all words of one of its
    aliases appear in the name, and the alias with the most words wins, so ``"NVIDIA H200
    NVL"`` finds the NVL row although ``"NVIDIA H200"`` (the SXM row) also matches. A tie
    between two rows, a MIG slice (``"... MIG 1g.18gb"``), or no match returns ``None``.
    """
    specs = load_table() if table is None else table
    if pci_device_id is not None:
        dev = _device_id16(int(pci_device_id))
        for spec in specs:
            if dev is not None and dev in spec.pci_device_ids:
                if name and "mig" in _tokens(name):
                    return None
                return spec
    if not name:
        return None
    words = set(_tokens(name))
    if "mig" in words:
        return None
    best: Optional[GpuSpec] = None
    best_len, tie = 0, False
    for spec in specs:
        n = max((len(a) for a in _alias_word_sets(spec) if a <= words), default=0)
        if n > best_len:
            best, best_len, tie = spec, n, False
        elif n and n == best_len and spec is not best:
            tie = True
    return None if tie else best


def unknown_gpu_message(name: Optional[str], pci_device_id: Optional[int] = None) -> str:
    """The one warning for a GPU missing from the table: names it and the two ways out."""
    ident = repr(name or "unnamed GPU")
    if pci_device_id is not None:
        ident += f" (PCI device id 0x{_device_id16(int(pci_device_id)) or 0:04X})"
    return (f"mfuwatch: no datasheet peak FLOP/s for GPU {ident}, so MFU is not reported. "
            f"Pass peak_flops=<dense FLOP/s of one GPU for the training dtype> "
            f"(e.g. watch(model, optimizer, peak_flops=989.4e12) for H200 bf16), or "
            f"calibrate=True to measure a large matmul, or add a row to {TABLE_PATH.name}.")


def _warn_once(kind: str, key: str, message: str) -> None:
    if (kind, key) not in _warned:
        _warned.add((kind, key))
        log.warning(message)


def _dtype_name(dtype: Any) -> str:
    """'torch.bfloat16' / torch.bfloat16 / 'bf16' -> a lower-case name without 'torch.'."""
    return str(dtype).lower().replace("torch.", "").strip()


#: The one dtype map: each peak-table key and the torch dtype its matmuls run in (tf32: fp32 storage on
#: TF32 tensor cores; fp8: e4m3, the format calibration measures). The spellings below are derived from it.
TORCH_DTYPES = {"fp32": "float32", "tf32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp8": "float8_e4m3fn"}
_KEY_BY_NAME = {**{name: key for key, name in TORCH_DTYPES.items() if key in ("fp32", "bf16", "fp16")},
                **{key: key for key in TORCH_DTYPES if key != "fp8"}, "float": "fp32", "half": "fp16"}


def torch_dtype(key: str) -> Any:
    """The torch dtype of peak-table key ``key`` (:data:`TORCH_DTYPES`); KeyError for another key."""
    import torch

    return getattr(torch, TORCH_DTYPES[key])


def training_dtype_key(torch_dtype: Any, autocast_dtype: Any = None, tf32_allowed: bool = False) -> str:
    """The peak-table key for the dtype the matmuls of a training step run in.

    ``autocast_dtype`` (bf16/fp16 under ``torch.autocast``) wins over the parameter dtype;
    fp32 matmuls use the TF32 tensor-core peak when ``tf32_allowed`` (see
    :func:`torch_allows_tf32`); any float8 dtype maps to ``"fp8"``. Accepts torch dtypes or
    their names (``"bfloat16"``, ``"bf16"``). Raises ValueError for other dtypes.
    """
    for dt in (autocast_dtype, torch_dtype):
        if dt is None:
            continue
        name = _dtype_name(dt)
        if name.startswith("float8") or name == "fp8":
            return "fp8"
        key = _KEY_BY_NAME.get(name)
        if key is None:
            raise ValueError(f"dtype {dt!r} has no peak-table entry; accepted: float32, tf32, "
                             f"bfloat16, float16, float8_*")
        if key == "fp32" and tf32_allowed:
            return "tf32"
        return key
    raise ValueError("training_dtype_key needs torch_dtype or autocast_dtype")


def torch_allows_tf32() -> bool:
    """True when torch runs fp32 CUDA matmuls on TF32 tensor cores.

    That is ``torch.backends.cuda.matmul.allow_tf32`` or
    ``torch.get_float32_matmul_precision() != "highest"`` (``"high"``/``"medium"``).
    """
    import torch

    with warnings.catch_warnings():  # newer torch may deprecate allow_tf32 in favour of fp32_precision
        warnings.simplefilter("ignore")
        allowed = bool(getattr(torch.backends.cuda.matmul, "allow_tf32", False))
    return allowed or torch.get_float32_matmul_precision() != "highest"


@dataclass
class Peaks:
    """Peak FLOP/s and memory bandwidth of one device: the MFU denominator and the roofline's input.

    ``peak_flops``: dense FLOP/s per key of :data:`PEAK_KEYS` ("fp32" = CUDA cores; "tf32",
    "bf16", "fp16", "fp8" = tensor cores), keys the device lacks left out.
    ``memory_bandwidth_bytes_per_second``: peak device-memory bandwidth (bytes/s).
    ``name``/``source``: the table row's product name and datasheet citation ("calibrated",
    "flags" otherwise). ``fp32_matmul``: the unit fp32 matmuls use, "fp32" (torch's default)
    or "tf32". ``measured_bandwidth_bytes_per_second``: a calibrated bandwidth, preferred for
    the replacement times of suggestions. The one serialised form (for the profiler window's
    child process) is :meth:`to_dict` / :meth:`from_any`.

    Raises:
        ValueError: no positive FLOP/s value, or a non-positive bandwidth.
    """

    peak_flops: Dict[str, float]
    memory_bandwidth_bytes_per_second: float
    name: str = ""
    source: str = ""
    measured_bandwidth_bytes_per_second: Optional[float] = None
    fp32_matmul: str = "fp32"

    def __post_init__(self) -> None:
        if not self.peak_flops or not any(v and v > 0 for v in self.peak_flops.values()):
            raise ValueError("peak_flops: need at least one positive FLOP/s value, e.g. {'fp32': 67e12}")
        if not self.memory_bandwidth_bytes_per_second or self.memory_bandwidth_bytes_per_second <= 0:
            raise ValueError("memory_bandwidth_bytes_per_second: need a positive bandwidth in bytes/s")
        if self.fp32_matmul not in ("fp32", "tf32"):
            raise ValueError(f"fp32_matmul: expected 'fp32' or 'tf32', got {self.fp32_matmul!r}")

    @classmethod
    def from_spec(cls, spec: GpuSpec) -> "Peaks":
        """The peaks of one table row (dtypes the GPU lacks left out)."""
        return cls(peak_flops={k: v for k, v in spec.peak_flops.items() if v},
                   memory_bandwidth_bytes_per_second=spec.memory_bandwidth_bytes_per_second,
                   name=spec.name, source=spec.source)

    @classmethod
    def from_any(cls, obj: Any) -> "Peaks":
        """Accept a :class:`Peaks`, a :class:`GpuSpec`, or a mapping with the fields of :meth:`to_dict`
        (``peak_flops`` and ``memory_bandwidth_bytes_per_second`` required).

        Raises:
            ValueError: missing or non-positive peak or bandwidth.
        """
        if isinstance(obj, cls):
            return obj
        if isinstance(obj, GpuSpec):
            return cls.from_spec(obj)
        get = obj.get if isinstance(obj, Mapping) else (lambda k, d=None: getattr(obj, k, d))
        measured = get("measured_bandwidth_bytes_per_second")
        return cls(peak_flops={k: float(v) for k, v in (get("peak_flops") or {}).items() if v},
                   memory_bandwidth_bytes_per_second=float(get("memory_bandwidth_bytes_per_second") or 0.0),
                   name=str(get("name", "") or ""), source=str(get("source", "") or ""),
                   measured_bandwidth_bytes_per_second=float(measured) if measured else None,
                   fp32_matmul=str(get("fp32_matmul", "fp32") or "fp32"))

    def to_dict(self) -> Dict[str, Any]:
        """JSON-ready fields; :meth:`from_any` reads them back into an equal :class:`Peaks`."""
        return dataclasses.asdict(self)

    def flops_for(self, dtype: Optional[str], matmul: bool) -> float:
        """Peak FLOP/s of the unit an op uses: tensor cores of ``dtype`` for matmul-like ops, else fp32."""
        fp32 = self.peak_flops.get("fp32") or max(self.peak_flops.values())
        if not matmul or dtype is None:
            return fp32
        key = self.fp32_matmul if dtype == "fp32" else dtype
        return self.peak_flops.get(key) or fp32

    def balance(self, dtype: Optional[str], matmul: bool) -> float:
        """Machine balance in FLOP/byte for that unit (peak FLOP/s / peak memory bandwidth)."""
        return self.flops_for(dtype, matmul) / self.memory_bandwidth_bytes_per_second


def resolve_peaks(name: Optional[str] = None, pci_device_id: Optional[int] = None, *,
                  peak_flops: Optional[Mapping[str, float]] = None,
                  memory_bandwidth_bytes_per_second: Optional[float] = None,
                  measured_bandwidth_bytes_per_second: Optional[float] = None, fp32_matmul: str = "fp32",
                  warn: bool = True) -> Optional[Peaks]:
    """The :class:`Peaks` of one GPU: the one resolver of the agent, the profiler window and ``analyze``.

    The table row is found by ``pci_device_id`` first (NVML's 32-bit ``pciDeviceId`` or a 16-bit
    device id), else by ``name`` (:func:`lookup`). ``peak_flops`` (FLOP/s per dtype key) and
    ``memory_bandwidth_bytes_per_second`` given together replace the table (``name`` is kept as the
    label); one of them alone overrides the row's values (``peak_flops`` key by key). Returns ``None`` when the GPU is not in the table and the values given do not
    make a complete :class:`Peaks`, after one warning naming the GPU (``warn=False``: silent, the
    caller reports it).

    Raises:
        ValueError: a ``peak_flops`` key outside :data:`PEAK_KEYS` or a non-positive value.
    """
    given = dict(peak_flops or {})
    for k, v in given.items():
        if k not in PEAK_KEYS or not (isinstance(v, (int, float)) and v > 0):
            raise ValueError(f"peak_flops: expected {{dtype: positive FLOP/s}} with dtype in {', '.join(PEAK_KEYS)}, "
                             f"got {k}={v!r}")
    complete = bool(given and memory_bandwidth_bytes_per_second)
    spec = lookup(name, pci_device_id) if not complete and (name or pci_device_id is not None) else None
    if spec is None and not complete:
        if warn:
            _warn_once("unknown", f"{name}/{pci_device_id}", unknown_gpu_message(name, pci_device_id))
        return None
    base = Peaks.from_spec(spec) if spec is not None else None
    return Peaks(peak_flops={**(base.peak_flops if base else {}), **{k: float(v) for k, v in given.items()}},
                 memory_bandwidth_bytes_per_second=float(memory_bandwidth_bytes_per_second
                                                         or base.memory_bandwidth_bytes_per_second),
                 name=spec.name if spec is not None else (name or ""),
                 source=spec.source if spec is not None else "flags",
                 measured_bandwidth_bytes_per_second=measured_bandwidth_bytes_per_second, fp32_matmul=fp32_matmul)


def mfu_peak(peaks: Optional[Peaks], dtype_key: str) -> Tuple[Optional[float], str]:
    """``(peak FLOP/s, source)`` of ``peaks`` for the training dtype key (the MFU denominator).

    ``(None, "")`` without peaks; ``(None, source)`` when the device has no unit for the dtype
    (FP8 on an A100), after one warning. Raises ValueError for a key outside :data:`DTYPES`.
    """
    if dtype_key not in DTYPES:
        raise ValueError(f"dtype: expected one of {', '.join(DTYPES)}, got {dtype_key!r}")
    if peaks is None:
        return None, ""
    value = peaks.peak_flops.get(dtype_key)
    if not value:
        _warn_once("dtype", f"{peaks.name}/{dtype_key}",
                   f"mfuwatch: {peaks.name or 'this device'} has no {dtype_key} peak ({peaks.source}); MFU is "
                   f"not reported. Pass peak_flops=<FLOP/s> or calibrate=True.")
        return None, peaks.source
    return value, peaks.source


def machine_balance(spec: GpuSpec, dtype: str, unit: str = "tensor") -> float:
    """Peak FLOP/s over peak memory bandwidth, in FLOP/byte (the machine balance, docs/architecture.md).

    ``unit="tensor"`` uses the dtype's tensor-core peak (``"fp32"`` is the CUDA-core rate,
    as in the table); ``unit="cuda"`` uses the fp32 CUDA-core peak whatever the dtype, the
    ceiling of elementwise and reduction kernels. H200 bf16: 989.4e12 / 4.8e12 = 206.1.
    Raises ValueError for an unknown unit or dtype, or a dtype the GPU lacks.
    """
    if unit not in ("tensor", "cuda"):
        raise ValueError(f"unit must be 'tensor' or 'cuda', got {unit!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    peak = spec.peak_flops["fp32"] if unit == "cuda" else spec.peak_flops[dtype]
    if peak is None:
        raise ValueError(f"{spec.name} has no {dtype} tensor-core peak")
    return peak / spec.memory_bandwidth_bytes_per_second
