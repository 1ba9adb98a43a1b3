"""MFU and HFU above 1.0 are never exported as if they were true.

A ratio of achieved FLOP/s to peak FLOP/s above 1.0 cannot happen on a device that ran at most
its peak: either the peak is too low (the wrong dtype's row, a calibration taken in another
dtype or while the device was busy) or the FLOP count is too high (a counted op that did not
run, a wrong ``flops_per_step``). Exporting it would let a dashboard show 663% MFU and silence
``MfuLow``. So each report passes through :func:`withhold_impossible` before it is exported:

* the impossible ratio is removed from the measurement (``mfu``/``hfu`` become ``None``, as when
  the peak is unknown: the exporter then serves no ``mfuwatch_mfu_ratio`` /
  ``mfuwatch_hfu_ratio`` series for that report; ``mfuwatch_model_flops_per_second`` still is,
  it does not depend on the peak);
* the value withheld is kept in ``StepMeasurement.implausible`` (``{"mfu": 6.63}``), so the
  timeline's step record still has it: nothing the job measured is dropped silently;
* :class:`ImplausibleRatioGuard` counts it in ``mfuwatch_implausible_ratio_total{ratio}``
  (one per report and ratio) and logs it once per ratio with what to check;
* the ``MfuImplausible`` alert (``alerts/data/default_rules.yaml``) fires on any increase of
  that counter, in the in-process engine (``implausible_ratio_increase``) and in Prometheus.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any, Dict, Optional, Tuple

from .schema import M, RunInfo, StepMeasurement

log = logging.getLogger("mfuwatch")

#: Ratios of achieved over peak FLOP/s above this are impossible (a device does not exceed its peak).
MAX_RATIO = 1.0
RATIOS = ("mfu", "hfu")


def withhold_impossible(m: StepMeasurement, limit: float = MAX_RATIO) -> Tuple[StepMeasurement, Dict[str, float]]:
    """``m`` without its ratios above ``limit``, and the values withheld.

    Args:
        m: one report interval; ``mfu``/``hfu`` are fractions of peak FLOP/s (or None).
        limit: the largest possible ratio (1.0: a device does not exceed its peak FLOP/s).
    Returns:
        ``(m2, withheld)``: ``m2`` is ``m`` itself when nothing exceeds ``limit``, else a copy whose
        ratios above ``limit`` are ``None`` and whose ``implausible`` maps each of them
        (``"mfu"``, ``"hfu"``) to the value withheld. NaN is withheld too (not a ratio).
    """
    withheld = {}
    for name in RATIOS:
        v = getattr(m, name)
        if v is not None and not (v <= limit):  # NaN fails every comparison
            withheld[name] = float(v)
    if not withheld:
        return m, {}
    changes: Dict[str, Any] = {name: None for name in withheld}
    changes["implausible"] = {**(m.implausible or {}), **withheld}
    return dataclasses.replace(m, **changes), withheld


def what_to_check(ratio: str, value: float, info: RunInfo) -> str:
    """One log line: the ratio, the peak and FLOP sources it rests on, and what to check first."""
    peak = info.peak_flops_per_second
    peak_text = f"{peak:.3g} FLOP/s" if peak else "unknown"
    return (f"mfuwatch: {ratio.upper()} {value:.3g} ({value * 100:.0f}%) is above 100% and is not exported "
            f"(mfuwatch_{ratio}_ratio has no value while it is; counted in {M.IMPLAUSIBLE_RATIO_TOTAL}). "
            f"It rests on the peak {peak_text} for dtype {info.dtype or '?'} (source: {info.peak_source or '?'}) "
            f"and the FLOPs from {info.flops_source or '?'}. Check: (1) the peak's dtype is the training dtype "
            f"(a bf16 run against an fp32 peak reads ~15x too high); (2) a calibrated peak was measured in that "
            f"dtype on an idle device (calibrate=True, or pass peak_flops=<FLOP/s>); (3) the FLOP count: "
            f"`mfuwatch flops` / agent.flops_breakdown(), or a flops_per_step you passed. Logged once per ratio.")


class ImplausibleRatioGuard:
    """Counts, logs once and withholds MFU/HFU above 1 (see the module docstring).

    Args:
        registry: the exporter's ``prometheus_client.CollectorRegistry``; the counter
            ``mfuwatch_implausible_ratio_total{run,rank,ratio}`` is registered on it (None: counted in
            :attr:`counts` only).
        run_info: the run's facts (labels; the peak, dtype and FLOP source the log line names). Read at
            each check, so a peak chosen later is the one named.
    """

    def __init__(self, registry: Optional[Any], run_info: RunInfo) -> None:
        self.run_info = run_info
        self.counts: Dict[str, int] = {}
        self._lock = threading.Lock()
        self._counter = None
        if registry is not None:
            from prometheus_client import Counter

            self._counter = Counter(M.IMPLAUSIBLE_RATIO_TOTAL.removesuffix("_total"),
                                    "Reports whose MFU or HFU came out above 1.0 and were not exported",
                                    ["run", "rank", "ratio"], registry=registry)
            for name in RATIOS:  # the series exist at 0 from the first scrape: increase() sees the first one
                self._counter.labels(run_info.run, str(run_info.rank), name)

    def check(self, m: StepMeasurement) -> StepMeasurement:
        """``m`` with any ratio above 1 withheld (:func:`withhold_impossible`), counted and logged once."""
        m2, withheld = withhold_impossible(m)
        for name, value in withheld.items():
            with self._lock:
                n = self.counts.get(name, 0) + 1
                self.counts[name] = n
            if self._counter is not None:
                self._counter.labels(self.run_info.run, str(self.run_info.rank), name).inc()
            if n == 1:
                log.warning(what_to_check(name, value, self.run_info))
        return m2
