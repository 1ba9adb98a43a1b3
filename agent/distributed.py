"""Multi-rank jobs (torchrun, DDP, FSDP): rank identity, a shared run name, and Prometheus discovery.

Under ``torchrun`` every rank runs its own agent: one exporter per process on
``base port + LOCAL_RANK``, every series labelled ``rank``, MFU per rank against
that rank's own GPU peak, notifications from global rank 0 only (alerts'
``notify_from_all_ranks``). This module adds what a fleet of such exporters
needs to be scraped:

* :func:`rank_from_env` — ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, read in one place;
* :func:`exporter_port` — ``base port + LOCAL_RANK``, computed in one place;
* :func:`default_run_name` — a ``run`` label that all ranks of one job agree on
  without a collective (read from torchrun's / Slurm's environment);
* :class:`FileSDTarget` — each rank writes one Prometheus *file-based service
  discovery* file (``file_sd_configs``) naming its own exporter, and removes it
  on a clean exit;
* :func:`scrape_config` — the Prometheus ``scrape_configs`` entry, either
  reading those files or a static pattern of N nodes x R ranks;
* :func:`end_process_group` — the end of a script's process group that does not
  abort the interpreter's exit on gloo (torch 2.13).

Print a scrape config::

    python -m mfuwatch.agent.distributed --file-sd-dir /shared/mfuwatch/targets
    python -m mfuwatch.agent.distributed --hosts node01,node02 --ranks-per-node 8

Imports only the standard library (and PyYAML for printing); torch only inside
:func:`end_process_group`.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import json
import logging
import os
import re
import socket
import tempfile
import threading
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union
from urllib.parse import urlsplit

log = logging.getLogger("mfuwatch")

#: Default exporter base port (the agent config's ``port``); rank r on a node serves on BASE_PORT + local rank.
BASE_PORT = 9478


def rank_from_env(env: Optional[Mapping[str, str]] = None) -> Tuple[int, int, int]:
    """``(rank, local_rank, world_size)`` from torchrun's ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``.

    The one reader of the rank environment (the agent config, the run name and the demo use it).
    Unset or empty variables give a single process: ``(0, 0, 1)``.

    Raises:
        ValueError: a variable that is not a non-negative integer (``WORLD_SIZE`` >= 1), named
            with its value.
    """
    env = os.environ if env is None else env
    out = []
    for name, default, low in (("RANK", 0, 0), ("LOCAL_RANK", 0, 0), ("WORLD_SIZE", 1, 1)):
        raw = env.get(name, "")
        try:
            value = int(raw) if raw != "" else default
        except ValueError:
            value = low - 1
        if value < low:
            raise ValueError(f"{name} (environment): expected an integer >= {low}, got {raw!r}")
        out.append(value)
    return out[0], out[1], out[2]


def exporter_port(base_port: int, local_rank: int) -> int:
    """The port rank ``local_rank`` of a node serves on: ``base_port + local_rank`` (0 stays 0: any free port).

    Raises:
        ValueError: when the result is outside 1..65535.
    """
    if base_port == 0:
        return 0
    port = base_port + local_rank
    if not 0 < port <= 65535:
        raise ValueError(f"exporter port {base_port} + local rank {local_rank} = {port} is outside 1..65535")
    return port


_LABEL_SAFE = re.compile(r"[^A-Za-z0-9_.:-]+")


def default_run_name(env: Optional[Mapping[str, str]] = None) -> str:
    """A run label that every rank of one job computes alike, with no communication.

    In order: ``MFUWATCH_RUN``; torchrun's rendezvous id ``TORCHELASTIC_RUN_ID``
    (a UUID on a single node without ``--rdzv-id``; ``"none"`` is skipped) as
    ``torchrun-<first 8 characters>``; Slurm's ``SLURM_JOB_ID`` as ``slurm-<id>``;
    for a multi-rank job without those, ``MASTER_ADDR`` and ``MASTER_PORT``
    (shared by all ranks, distinct for concurrent jobs on one master); else
    ``<host>-<pid>`` (a single process). The one run-name default: the agent config fills an
    empty ``run`` with it. Raises ValueError for a malformed ``WORLD_SIZE`` (:func:`rank_from_env`).
    """
    env = os.environ if env is None else env
    if env.get("MFUWATCH_RUN"):
        return env["MFUWATCH_RUN"]
    rid = env.get("TORCHELASTIC_RUN_ID", "")
    if rid and rid.lower() != "none":
        rid = _LABEL_SAFE.sub("-", rid)
        return "torchrun-" + (rid[:8] if re.fullmatch(r"[0-9a-f-]{36}", rid) else rid)
    if env.get("SLURM_JOB_ID"):
        return "slurm-" + _LABEL_SAFE.sub("-", env["SLURM_JOB_ID"])
    if rank_from_env(env)[2] > 1 and env.get("MASTER_ADDR"):
        return "job-" + _LABEL_SAFE.sub("-", f"{env['MASTER_ADDR']}-{env.get('MASTER_PORT', '')}").strip("-")
    return f"{socket.gethostname()}-{os.getpid()}"


def advertised_host(bind: str) -> str:
    """The host name Prometheus should use to reach an exporter bound to ``bind``.

    Loopback binds advertise ``127.0.0.1`` (a Prometheus on the same node);
    wildcard binds (``0.0.0.0``, ``::``, ``""``) advertise this node's fully
    qualified name; any other address is advertised as given.
    """
    if bind in ("0.0.0.0", "::", ""):
        return socket.getfqdn()
    return bind


class FileSDTarget:
    """One rank's entry for Prometheus ``file_sd_configs``: ``<directory>/<run>-rank<R>.json``.

    The file holds one target group, in the format Prometheus documents for
    file-based service discovery (a JSON list of ``{"targets": [...], "labels": {...}}``)::

        [{"targets": ["node07.cluster:9481"], "labels": {"__metrics_path__": "/metrics"}}]

    Each rank writes its own file (no two processes write one file), atomically
    (temporary file + rename, so Prometheus never reads half a file), naming the
    port the exporter really serves on. ``run`` and ``rank`` are not target
    labels: the series carry them already, and Prometheus would rename clashing
    scraped labels to ``exported_*``.

    Args:
        directory: where the files go (created if missing): a shared file system
            for a central Prometheus, or a node-local one for a per-node scraper.
        run, rank: name the file (the run name is made file-name safe).
        url: the exporter's ``/metrics`` URL (``agent.exporter_url``).
        host: the host Prometheus should dial; default: the URL's host.
        labels: extra target labels (e.g. ``{"cluster": "a"}``); names starting
            with ``__`` are Prometheus's own (``__scheme__`` is set from the URL).

    Raises:
        ValueError: a URL without a port, or a label named ``run``/``rank``.
    """

    def __init__(self, directory: Union[str, os.PathLike], *, run: str, rank: int, url: str,
                 host: Optional[str] = None, labels: Optional[Mapping[str, str]] = None) -> None:
        parts = urlsplit(url)
        if parts.port is None:
            raise ValueError(f"exporter URL {url!r} has no port")
        clash = {"run", "rank"} & set(labels or {})
        if clash:
            raise ValueError(f"labels: {sorted(clash)} are already on every series; choose other names")
        self.directory = Path(directory)
        self.path = self.directory / f"{_LABEL_SAFE.sub('_', run)}-rank{int(rank)}.json"
        h = host or parts.hostname or "127.0.0.1"
        self.target = f"[{h}]:{parts.port}" if ":" in h else f"{h}:{parts.port}"
        self.labels: Dict[str, str] = {"__metrics_path__": parts.path or "/metrics"}
        if parts.scheme == "https":
            self.labels["__scheme__"] = "https"
        self.labels.update({str(k): str(v) for k, v in (labels or {}).items()})
        self._lock = threading.Lock()
        self._written = False

    def document(self) -> List[Dict[str, Any]]:
        """The JSON document written to :attr:`path`."""
        return [{"targets": [self.target], "labels": dict(self.labels)}]

    def write(self) -> Path:
        """Write (or rewrite) the file atomically; returns its path.

        Raises:
            OSError: the directory cannot be created or written.
        """
        with self._lock:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".mfuwatch-", suffix=".tmp", dir=self.directory)
            try:
                with os.fdopen(fd, "w") as fh:
                    json.dump(self.document(), fh, indent=1)
                os.chmod(tmp, 0o644)
                os.replace(tmp, self.path)  # atomic on POSIX: readers see the old or the new file
            except BaseException:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                raise
            if not self._written:
                self._written = True
                atexit.register(self.remove)
        return self.path

    def remove(self) -> None:
        """Delete the file (the target disappears from Prometheus). Idempotent; never raises."""
        with self._lock:
            if not self._written:
                return
            self._written = False
            try:
                self.path.unlink()
            except OSError:
                pass
        try:
            atexit.unregister(self.remove)
        except Exception:  # noqa: BLE001
            pass


def register_agent(agent: Any, directory: Union[str, os.PathLike], *, host: Optional[str] = None,
                   labels: Optional[Mapping[str, str]] = None) -> Optional[FileSDTarget]:
    """Write the file-SD entry of a running :class:`~mfuwatch.agent.Agent`'s exporter.

    The host is ``host``, else ``$MFUWATCH_ADVERTISE_HOST``, else
    :func:`advertised_host` of the agent's ``bind``. Returns the written
    :class:`FileSDTarget` (call ``.remove()`` when the agent closes; it is also
    removed at interpreter exit), or ``None`` when the agent has no exporter.
    Failures are counted in the agent's ``mfuwatch_agent_errors_total{component="file_sd"}``
    and never raised.
    """
    try:
        if not getattr(agent, "exporter_url", ""):
            return None
        host = host or os.environ.get("MFUWATCH_ADVERTISE_HOST") or advertised_host(agent.config.bind)
        target = FileSDTarget(directory, run=agent.run_info.run, rank=agent.run_info.rank,
                              url=agent.exporter_url, host=host, labels=labels)
        target.write()
        return target
    except Exception as exc:  # noqa: BLE001 - discovery must never break training
        errors = getattr(agent, "errors", None)
        if errors is not None:
            errors.count("file_sd", exc)
        else:
            log.warning("mfuwatch: could not write the file-SD target: %s", exc)
        return None


def static_targets(hosts: Sequence[str], ranks_per_node: int = 8, base_port: int = BASE_PORT) -> List[str]:
    """``host:port`` of every exporter of a job on ``hosts`` with ``ranks_per_node`` ranks each.

    Raises:
        ValueError: no hosts, ``ranks_per_node`` < 1, or a port past 65535.
    """
    if not hosts:
        raise ValueError("hosts: give at least one host")
    if ranks_per_node < 1:
        raise ValueError(f"ranks_per_node: expected >= 1, got {ranks_per_node}")
    return [f"{h}:{exporter_port(base_port, r)}" for h in hosts for r in range(ranks_per_node)]


def scrape_config(job: str = "mfuwatch", *, file_sd_dir: Optional[str] = None,
                  hosts: Optional[Sequence[str]] = None, ranks_per_node: int = 8, base_port: int = BASE_PORT,
                  scrape_interval: str = "15s", scheme: str = "http") -> Dict[str, Any]:
    """A Prometheus configuration fragment ``{"scrape_configs": [ {...} ]}`` for the agents' exporters.

    Exactly one of ``file_sd_dir`` (the directory the ranks write with
    :class:`FileSDTarget`; Prometheus watches ``*.json`` there) and ``hosts``
    (a static pattern: every host x ``ranks_per_node`` ports from ``base_port``)
    must be given. ``honor_labels`` is true: every series carries its own ``job``
    label (the training job, ``MFUWATCH_JOB`` / Slurm / Kubernetes), which must win
    over the scrape job's name, else Prometheus renames it ``exported_job`` and the
    fleet rules, grouped by ``job``, merge different training jobs.

    Raises:
        ValueError: both or neither of ``file_sd_dir`` and ``hosts``; a bad scheme.
    """
    if (file_sd_dir is None) == (hosts is None):
        raise ValueError("give exactly one of file_sd_dir (file-based discovery) and hosts (static targets)")
    if scheme not in ("http", "https"):
        raise ValueError(f"scheme: expected http or https, got {scheme!r}")
    entry: Dict[str, Any] = {"job_name": job, "scrape_interval": scrape_interval, "metrics_path": "/metrics",
                             "honor_labels": True}
    if scheme == "https":
        entry["scheme"] = "https"
    if file_sd_dir is not None:
        entry["file_sd_configs"] = [{"files": [str(Path(file_sd_dir) / "*.json")], "refresh_interval": "30s"}]
    else:
        entry["static_configs"] = [{"targets": static_targets(list(hosts or ()), ranks_per_node, base_port)}]
    return {"scrape_configs": [entry]}


def end_process_group() -> None:
    """Destroy the default process group of ``torch.distributed`` so that the process exits cleanly.

    Runs the cyclic garbage collector, then ``torch.distributed.destroy_process_group()``, then the
    collector again. Objects in reference cycles (a DDP or FSDP module, an optimizer, an autograd graph)
    can hold the process group's C++ backend; freed only during interpreter finalization, a gloo backend
    on torch 2.13 (CPU) sometimes aborts the process there (``terminate called without an active
    exception``, SIGABRT, after the script's work has finished; measured in docs/fleet.md, Known limits).
    Freeing them while Python still runs avoids it. Release your own references to the models first
    (``del model``) for the collector to free them, and call it last: torch lets a DDP module or a
    subgroup be used after the destroy without an error, and such use brings the abort back.

    A no-op when ``torch.distributed`` is unavailable or not initialized; errors from the destroy call
    propagate (a script's own shutdown, not the agent's).
    """
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch without distributed
        return
    if not (dist.is_available() and dist.is_initialized()):
        return
    gc.collect()
    dist.destroy_process_group()
    gc.collect()


def main(argv: Optional[List[str]] = None) -> int:
    """Print a Prometheus scrape config (YAML) for mfuwatch exporters. Returns 0, or 2 on bad arguments."""
    import yaml

    p = argparse.ArgumentParser(prog="python -m mfuwatch.agent.distributed",
                                description="Print a Prometheus scrape config for mfuwatch exporters.")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--file-sd-dir", help="directory the agents write their target files to (file_sd_dir)")
    g.add_argument("--hosts", help="comma-separated host names of the job's nodes (static targets)")
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--base-port", type=int, default=BASE_PORT)
    p.add_argument("--job", default="mfuwatch")
    p.add_argument("--scrape-interval", default="15s")
    p.add_argument("--scheme", default="http", choices=("http", "https"))
    a = p.parse_args(argv)
    hosts = [h.strip() for h in a.hosts.split(",") if h.strip()] if a.hosts else None
    try:
        cfg = scrape_config(a.job, file_sd_dir=a.file_sd_dir, hosts=hosts, ranks_per_node=a.ranks_per_node,
                            base_port=a.base_port, scrape_interval=a.scrape_interval, scheme=a.scheme)
    except ValueError as exc:
        p.error(str(exc))  # exits 2
    print(yaml.safe_dump(cfg, sort_keys=False), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
