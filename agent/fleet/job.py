"""The ``job`` label: one value shared by every rank of a training job, found without communication.

Every series the agent exports carries ``job`` beside ``run`` and ``rank``
(``docs/architecture.md``, metrics contract), so that recording rules can aggregate a
whole job (``sum by (job, run) (...)``) in any store the series reach. The
value comes from, in order:

1. ``MFUWATCH_JOB`` (or the agent setting ``job:``), when the user names it;
2. Slurm's ``SLURM_JOB_ID`` (every task of one allocation shares it), as
   ``slurm-<id>``;
3. Kubernetes: the ``JOB_NAME`` variable that the Kubeflow training operator
   and the manifests in ``docs/examples/kubernetes/`` set (from the pod's
   ``batch.kubernetes.io/job-name`` label through the downward API), else the
   pod name in ``HOSTNAME`` with the Job controller's suffixes removed
   (``<job>-<completion index>-<5 random characters>`` or
   ``<job>-<5 random characters>``);
4. the run label (one job = one run when nothing else is known).

The value is sanitised to Prometheus-safe characters and cut to 128
characters, so a bad variable cannot make a label unbounded or unparsable.
:func:`job_labelled_view` wraps the agent's ``CollectorRegistry`` so that
every sample it yields — including series other components register on it,
such as the alert engine's — carries the label.
"""

from __future__ import annotations

import os
import re
from typing import Any, Iterable, Mapping, Optional

#: Longest ``job`` value kept (a label value is per job, but a runaway variable must not grow it).
MAX_JOB_LENGTH = 128
_UNSAFE = re.compile(r"[^A-Za-z0-9_.:-]+")
#: Kubernetes Job pod names: <job>[-<index>]-<5 lowercase alphanumerics> (kube-controller-manager's
#: generateName suffix is 5 characters from "bcdfghjklmnpqrstvwxz2456789").
_K8S_POD = re.compile(r"^(?P<job>[a-z0-9]([-a-z0-9]*?[a-z0-9])?)(-\d+)?-[bcdfghjklmnpqrstvwxz2456789]{5}$")


def _clean(value: str) -> str:
    return _UNSAFE.sub("-", value.strip()).strip("-")[:MAX_JOB_LENGTH]


def kubernetes_job_name(env: Mapping[str, str]) -> Optional[str]:
    """The Kubernetes Job name of this pod, or ``None`` outside Kubernetes (no ``KUBERNETES_SERVICE_HOST``)."""
    if not env.get("KUBERNETES_SERVICE_HOST"):
        return None
    if env.get("JOB_NAME"):
        return env["JOB_NAME"]
    pod = env.get("HOSTNAME", "")
    m = _K8S_POD.match(pod)
    if m:
        return m.group("job")
    return pod or None


def resolve_job(run: str, setting: str = "", env: Optional[Mapping[str, str]] = None) -> str:
    """The ``job`` label value for this process.

    Args:
        run: the run label (the fallback).
        setting: the agent's ``job`` setting; wins over the environment when not empty.
        env: environment mapping (``os.environ`` by default).

    Returns:
        A non-empty string of ``[A-Za-z0-9_.:-]``, at most :data:`MAX_JOB_LENGTH` characters.
    """
    env = os.environ if env is None else env
    for candidate in (setting, env.get("MFUWATCH_JOB", "")):
        if candidate and _clean(candidate):
            return _clean(candidate)
    if env.get("SLURM_JOB_ID") and _clean(env["SLURM_JOB_ID"]):
        return "slurm-" + _clean(env["SLURM_JOB_ID"])
    k8s = kubernetes_job_name(env)
    if k8s and _clean(k8s):
        return _clean(k8s)
    return _clean(run) or "unknown"


class _AddJob:
    """A collector forwarding another registry's samples with ``job`` added (see :func:`job_labelled_view`)."""

    def __init__(self, inner: Any, job: str) -> None:
        self.inner = inner
        self.job = job

    def collect(self) -> Iterable[Any]:
        job = self.job
        for family in self.inner.collect():
            family.samples = [s if "job" in s.labels else s._replace(labels={**s.labels, "job": job})
                              for s in family.samples]
            yield family


def job_labelled_view(registry: Any, job: str) -> Any:
    """A ``CollectorRegistry`` exposing ``registry``'s samples, each with ``job=<job>`` added.

    Samples that already have a ``job`` label keep theirs. The exporter serves
    this view (HTTP ``/metrics``, ``generate_latest``) and the OTLP bridge reads
    it, so every series leaves the process with ``run``, ``rank`` and ``job``;
    the agent's own registry is left as it is (``get_sample_value`` on it keeps
    matching ``{run, rank}``). Metric families are re-created by each
    ``collect()`` of prometheus-client, so adding the label mutates nothing shared.
    """
    from prometheus_client import CollectorRegistry

    view = CollectorRegistry(auto_describe=False)
    view.register(_AddJob(registry, job))
    return view
