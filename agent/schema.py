"""The data contract of mfuwatch: metric names and the measurement dataclasses.

Everything that leaves the agent goes through the names and types defined here:
the Prometheus exporter, the local JSONL timeline, the alert engine
(:mod:`mfuwatch.alerts` is handed these dataclasses and never reaches into the
agent), the Grafana dashboards and the generated Prometheus alerting rules.
This module imports nothing heavier than the standard library, so the alert
and report command lines can read it without importing torch.

Definitions (as in ``docs/architecture.md``):

* **MFU** = model FLOPs per step / step time / peak FLOP/s of one GPU for the
  training dtype, per rank. Model FLOPs count the forward and backward of the
  model as written, without activation recomputation (PaLM, Chowdhery et al.
  2022, appendix B). **HFU** counts the FLOPs actually executed,
  recomputation included.
* **Arithmetic intensity** of a kernel = FLOPs / bytes moved to and from device
  memory. **Machine balance** = peak FLOP/s / peak memory bandwidth.
  A kernel below the balance is **memory-bound**.
* **Memory-bound share** = GPU time in memory-bound kernels / GPU busy time in
  a profiler window.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

PREFIX = "mfuwatch_"


class M:
    """Metric names (full Prometheus names, ``mfuwatch_`` prefix, base units in the name).

    Every series carries the labels ``run`` and ``rank``; extra labels are listed
    in :data:`EXTRA_LABELS`. Histograms and counters are named as Prometheus
    exposes them (``_total`` for counters; the histogram's base name, whose
    ``_bucket``/``_sum``/``_count`` series the exporter adds).
    """

    RUN_INFO = PREFIX + "run_info"
    MFU = PREFIX + "mfu_ratio"
    HFU = PREFIX + "hfu_ratio"
    MODEL_FLOPS_PER_SECOND = PREFIX + "model_flops_per_second"
    PEAK_FLOPS_PER_SECOND = PREFIX + "peak_flops_per_second"
    TOKENS_PER_SECOND = PREFIX + "tokens_per_second"
    STEP_DURATION_SECONDS = PREFIX + "step_duration_seconds"  # histogram
    LAST_STEP_DURATION_SECONDS = PREFIX + "last_step_duration_seconds"
    STEPS_TOTAL = PREFIX + "steps_total"
    TOKENS_TOTAL = PREFIX + "tokens_total"
    LAST_STEP_TIMESTAMP_SECONDS = PREFIX + "last_step_timestamp_seconds"
    # seconds since the last step or agent phase end on the agent's monotonic clock; absent while a phase is
    # open and before the first step (the TrainingStalled value of both alert paths, alerts/stall.py)
    STALL_SECONDS = PREFIX + "stall_seconds"
    # NVML GPM ratios averaged over the last report interval's timed steps (the MFU cross-check's other side)
    INTERVAL_TENSOR_ACTIVE = PREFIX + "interval_tensor_active_ratio"
    INTERVAL_TENSOR_ACTIVE_BOUND = PREFIX + "interval_tensor_active_bound_ratio"
    INTERVAL_SM_ACTIVE = PREFIX + "interval_sm_active_ratio"
    INTERVAL_DRAM_ACTIVE = PREFIX + "interval_dram_active_ratio"
    # profiler windows
    GPU_TIME_SHARE = PREFIX + "gpu_time_share_ratio"  # {category}
    MEMORY_BOUND_SHARE = PREFIX + "memory_bound_share_ratio"
    OP_GPU_TIME_SHARE = PREFIX + "op_gpu_time_share_ratio"  # {op,bound}
    SUGGESTION_EXPECTED_GAIN = PREFIX + "suggestion_expected_gain_ratio"  # {kernel}
    SUGGESTION_ORDER = PREFIX + "suggestion_order"  # {kernel}: 1 = the agent's first suggestion
    PROFILE_WINDOWS_TOTAL = PREFIX + "profile_windows_total"  # {outcome}
    KERNELS_PER_STEP = PREFIX + "kernels_per_step"
    MEAN_KERNEL_DURATION_SECONDS = PREFIX + "mean_kernel_duration_seconds"
    # NVML
    GPU_UTILIZATION = PREFIX + "gpu_utilization_ratio"
    GPU_MEMORY_UTILIZATION = PREFIX + "gpu_memory_bandwidth_utilization_ratio"
    GPU_SM_CLOCK_HERTZ = PREFIX + "gpu_sm_clock_hertz"
    GPU_SM_CLOCK_MAX_HERTZ = PREFIX + "gpu_sm_clock_max_hertz"  # for the tensor-activity cross-check of MFU
    GPU_POWER_WATTS = PREFIX + "gpu_power_watts"
    GPU_POWER_LIMIT_WATTS = PREFIX + "gpu_power_limit_watts"
    GPU_TEMPERATURE_CELSIUS = PREFIX + "gpu_temperature_celsius"
    GPU_MEMORY_USED_BYTES = PREFIX + "gpu_memory_used_bytes"
    GPU_MEMORY_TOTAL_BYTES = PREFIX + "gpu_memory_total_bytes"
    GPU_ENERGY_JOULES_TOTAL = PREFIX + "gpu_energy_joules_total"
    GPU_CLOCK_EVENT_REASON = PREFIX + "gpu_clock_event_reason"  # {reason}
    GPU_SM_ACTIVE = PREFIX + "gpu_sm_active_ratio"
    GPU_TENSOR_ACTIVE = PREFIX + "gpu_tensor_active_ratio"
    GPU_DRAM_ACTIVE = PREFIX + "gpu_dram_active_ratio"
    GPU_XID_ERRORS_TOTAL = PREFIX + "gpu_xid_errors_total"
    GPU_ECC_ERRORS_TOTAL = PREFIX + "gpu_ecc_errors_total"  # {type}
    # the agent itself and the notifiers
    AGENT_ERRORS_TOTAL = PREFIX + "agent_errors_total"  # {component}
    IMPLAUSIBLE_RATIO_TOTAL = PREFIX + "implausible_ratio_total"  # {ratio}: MFU/HFU above 1, not exported
    SIGNALS_TOTAL = PREFIX + "signals_total"  # {signal}: preemption signals the agent closed on (agent/live)
    NOTIFICATIONS_TOTAL = PREFIX + "notifications_total"  # {sink,outcome}
    # the exporter's own server (agent/live/http_server.py, in the server child by default: server_process.py)
    EXPORTER_REQUESTS_TOTAL = PREFIX + "exporter_requests_total"  # {code}: requests answered, by HTTP status
    EXPORTER_DROPPED_CONNECTIONS_TOTAL = PREFIX + "exporter_dropped_connections_total"  # {reason}
    EXPORTER_SERVER_CPU_SECONDS_TOTAL = PREFIX + "exporter_server_cpu_seconds_total"  # child process / loop thread
    ALERTS_FIRING = PREFIX + "alerts_firing"  # {alertname,severity}
    # --- fleet: aggregation-friendly counters, goodput, hangs, stragglers (agent/fleet/accounting.py) ---
    MODEL_FLOPS_TOTAL = PREFIX + "model_flops_total"
    HARDWARE_FLOPS_TOTAL = PREFIX + "hardware_flops_total"
    STEP_SECONDS_TOTAL = PREFIX + "step_seconds_total"
    GOODPUT_SECONDS_TOTAL = PREFIX + "goodput_seconds_total"  # {bucket}
    GOODPUT_RATIO = PREFIX + "goodput_ratio"
    STRAGGLER_SCORE = PREFIX + "straggler_score_ratio"
    HANGS_TOTAL = PREFIX + "hangs_total"
    HANG_INFO = PREFIX + "hang_info"  # {frame,collective}: one series while a step is stuck
    PHASE_IN_PROGRESS = PREFIX + "phase_in_progress"  # 1 while an agent.phase() (eval, checkpoint) is open, else 0
    LAST_PHASE_END_TIMESTAMP_SECONDS = PREFIX + "last_phase_end_timestamp_seconds"  # unix time; 0 before the first


#: The labels every series carries (``job`` is added by the exporter's view, :mod:`mfuwatch.agent.fleet.job`).
BASE_LABELS = ("run", "rank", "job")

#: Labels beyond ``run``/``rank`` for the metrics that have them.
EXTRA_LABELS: Dict[str, tuple] = {
    M.GPU_TIME_SHARE: ("category",),
    M.OP_GPU_TIME_SHARE: ("op", "bound"),
    M.SUGGESTION_EXPECTED_GAIN: ("kernel",),
    M.SUGGESTION_ORDER: ("kernel",),
    M.PROFILE_WINDOWS_TOTAL: ("outcome",),
    M.GPU_CLOCK_EVENT_REASON: ("reason",),
    M.GPU_ECC_ERRORS_TOTAL: ("type",),
    M.AGENT_ERRORS_TOTAL: ("component",),
    M.IMPLAUSIBLE_RATIO_TOTAL: ("ratio",),  # "mfu" | "hfu" (agent/plausibility.py)
    M.SIGNALS_TOTAL: ("signal",),
    M.NOTIFICATIONS_TOTAL: ("sink", "outcome"),
    M.EXPORTER_REQUESTS_TOTAL: ("code",),  # 200, 400, 401, 404, 405, 431
    M.EXPORTER_DROPPED_CONNECTIONS_TOTAL: ("reason",),  # over_cap, timeout_<state>, io_<state>, tls_wrap, accept_*
    M.ALERTS_FIRING: ("alertname", "severity"),
    M.GOODPUT_SECONDS_TOTAL: ("bucket",),  # fleet: the 9 buckets of agent/fleet/goodput.py
    M.HANG_INFO: ("frame", "collective"),  # fleet: at most one series, while a step is stuck
}

#: Time-breakdown categories of a profiler window. The GPU-busy ones sum to 1
#: over busy time; ``idle`` is a share of the window's wall time.
BUSY_CATEGORIES = ("compute_bound", "memory_bound", "communication", "other")
CATEGORIES = BUSY_CATEGORIES + ("idle",)


@dataclass
class RunInfo:
    """Static facts about a run, exported as ``mfuwatch_run_info{...} 1``.

    Produced by :class:`mfuwatch.agent.core.Agent` at start-up (peak and dtype filled in once the
    first forward shows the training dtype); read by the exporter, the timeline and the alerts.
    """

    run: str
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    host: str = ""
    device: str = "cpu"
    gpu_name: str = ""
    dtype: str = "fp32"
    peak_flops_per_second: Optional[float] = None  # FLOP/s, one device, training dtype
    peak_source: str = ""  # datasheet citation, "calibrated", "user", or "" when unknown
    peak_memory_bandwidth_bytes_per_second: Optional[float] = None
    flops_source: str = ""  # "user" | "analytic" | "flop_counter"
    flops_convention: str = ""  # "palm" | "megatron" | "6n" (agent/flops/conventions.py)
    flops_inputs: Dict[str, Any] = field(default_factory=dict)  # N, layers, heads, head_dim, width, seq_len
    exporter_url: str = ""
    job: str = ""  # fleet: the `job` label (agent/fleet/job.py), shared by every rank of one job
    versions: Dict[str, str] = field(default_factory=dict)


@dataclass
class StepMeasurement:
    """One measured interval of optimizer steps (the unit the agent reports on).

    ``step`` is the index of the last optimizer step in the interval; ``steps``
    how many steps the interval covers. Durations in seconds, FLOPs in FLOP,
    rates per second. ``mfu``/``hfu`` are ``None`` when the peak is unknown, or when they came out
    above 1.0 (impossible; the value is kept in ``implausible``, see agent/plausibility.py).

    Produced by ``Agent._report`` (agent/live/reporter.py) on the agent thread, from the step clock's
    intervals (agent/live/clock.py), the FLOP model and the peak of :mod:`mfuwatch.agent.device.peaks`.
    """

    step: int
    steps: int
    timestamp: float  # unix seconds at the end of the interval
    step_time_seconds: float  # mean time of one optimizer step in the interval
    tokens: int  # tokens in the interval (all micro-batches)
    tokens_per_second: float
    model_flops: float  # model FLOPs per optimizer step (no recomputation)
    hardware_flops: float  # executed FLOPs per optimizer step (recomputation included)
    model_flops_per_second: float
    mfu: Optional[float] = None
    hfu: Optional[float] = None
    loss: Optional[float] = None  # the last step's loss when known (record_loss / step(loss=)), else None
    tokens_per_step: Optional[float] = None  # mean tokens of one optimizer step: per step, like model_flops
    # NVML GPM ratios (0..1) averaged over this interval's timed steps (agent/activity.py); None without GPM,
    # or when an agent phase fell in the interval: the cross-check compares MFU with these, never with the
    # latest sample
    tensor_active: Optional[float] = None
    tensor_active_bound: Optional[float] = None  # tensor_active x SM clock / max SM clock
    sm_active: Optional[float] = None
    dram_active: Optional[float] = None
    #: ratios above 1.0 withheld from ``mfu``/``hfu`` (``{"mfu": 6.63}``; agent/plausibility.py), else empty
    implausible: Dict[str, float] = field(default_factory=dict)


@dataclass
class OpShare:
    """One op's share of GPU busy time in a profiler window.

    Produced by :func:`mfuwatch.agent.analysis.roofline.measure` (``WindowMeasurement.top_ops``).
    """

    op: str  # aten op name (e.g. ``aten::mm``) or a kernel-name rule's label
    bound: str  # "compute" | "memory" | "communication" | "other"
    share: float  # of GPU busy time, 0..1
    time_seconds: float  # GPU time in the window
    kernels: int = 0
    flops: float = 0.0
    bytes: float = 0.0
    arithmetic_intensity: Optional[float] = None  # FLOP/byte


@dataclass
class Suggestion:
    """A remedy for memory-bound or launch-bound time, ranked existing fix first.

    Produced by :func:`mfuwatch.agent.analysis.suggest.suggest` from the remedies registry of
    :mod:`mfuwatch.kernels` (``WindowMeasurement.suggestions``).
    """

    kernel: str  # short id, e.g. "rms_norm", "fused_adamw", "torch_compile"
    title: str
    apply: str  # the one line that applies it
    ops: List[str]  # op patterns it replaces, as matched in the window
    time_seconds: float  # GPU time of those ops in the window, per step
    expected_gain: float  # fraction of step time saved (Amdahl), 0..1
    kind: str = "existing"  # "existing" (torch feature) | "bundled" (mfuwatch.kernels)
    #: its gain on top of the suggestions ranked before it (the op time they did not already claim); None:
    #: not computed (an older record)
    gain_in_set: Optional[float] = None
    #: the suggestion ranked before it that already removes most of its time (e.g. "torch_compile" for the
    #: drop-ins Inductor fuses anyway): it is not part of the proposed set; None: it is
    covered_by: Optional[str] = None


@dataclass
class WindowMeasurement:
    """The result of one profiler window (or of ``mfuwatch analyze`` on a trace).

    Produced by :func:`mfuwatch.agent.analysis.analyze.analyze_events`, in the profiler sampler's
    child process (agent/live/profiler.py) for live windows; it crosses back as one JSON record
    (:func:`to_record` there, :func:`window_from_record` here).
    """

    step: int
    timestamp: float
    steps: int  # active steps in the window
    wall_seconds: float
    busy_seconds: float
    breakdown: Dict[str, float]  # CATEGORIES -> share; busy ones over busy time, idle over wall
    memory_bound_share: float
    top_ops: List[OpShare] = field(default_factory=list)
    suggestions: List[Suggestion] = field(default_factory=list)
    kernels_per_step: float = 0.0
    mean_kernel_seconds: float = 0.0
    step_time_seconds: Optional[float] = None
    #: gain of applying every suggestion not ``covered_by`` another together (Amdahl over disjoint op time,
    #: not the sum of the parts), fraction of step time; None: not computed
    combined_gain: Optional[float] = None


@dataclass
class GpuHealth:
    """One NVML sample. Any field is ``None`` when the GPU or driver does not report it.

    Produced by :class:`mfuwatch.agent.device.nvml.NvmlSampler` on its own thread, about once a second.
    """

    timestamp: float
    utilization: Optional[float] = None  # 0..1
    memory_bandwidth_utilization: Optional[float] = None  # 0..1
    sm_clock_hertz: Optional[float] = None
    sm_clock_max_hertz: Optional[float] = None  # NVML max SM clock (the clock the peak FLOP/s assume)
    power_watts: Optional[float] = None
    power_limit_watts: Optional[float] = None
    temperature_celsius: Optional[float] = None
    memory_used_bytes: Optional[float] = None
    memory_total_bytes: Optional[float] = None
    energy_joules: Optional[float] = None  # since driver load
    clock_event_reasons: Dict[str, bool] = field(default_factory=dict)
    ecc_errors: Dict[str, int] = field(default_factory=dict)  # "corrected"/"uncorrected" -> count
    xid_errors: int = 0
    sm_active: Optional[float] = None  # GPM, 0..1
    tensor_active: Optional[float] = None  # GPM, 0..1
    dram_active: Optional[float] = None  # GPM, 0..1


def to_record(kind: str, obj: Any) -> Dict[str, Any]:
    """Turn a measurement dataclass into one JSON-ready timeline record ``{"kind": ..., **fields}``."""
    rec = dataclasses.asdict(obj)
    rec["kind"] = kind
    return rec


def window_from_record(rec: Dict[str, Any]) -> WindowMeasurement:
    """Rebuild a :class:`WindowMeasurement` from its :func:`to_record` form (``mfuwatch analyze --json``).

    Keys that are not fields (``kind``, ``analysis``) are dropped. Raises TypeError when a
    required field is missing.
    """
    names = {f.name for f in dataclasses.fields(WindowMeasurement)}
    d = {k: v for k, v in rec.items() if k in names}
    d["top_ops"] = [OpShare(**o) for o in d.get("top_ops", [])]
    d["suggestions"] = [Suggestion(**s) for s in d.get("suggestions", [])]
    return WindowMeasurement(**d)
