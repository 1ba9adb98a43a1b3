"""Agent configuration: one YAML file plus keyword arguments, validated at start-up.

Sources, later ones win: built-in defaults < the YAML file named by ``config=``
(or by the ``MFUWATCH_CONFIG`` environment variable) < keyword arguments.
A bad value or an unknown key raises :class:`ConfigError` at start-up, naming the
field and the accepted values (or, for an unknown key, the nearest valid key):
a misconfigured agent fails fast instead of measuring the wrong thing for hours.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Tuple, Union

import yaml

from .distributed import default_run_name, exporter_port, rank_from_env

DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8")
#: Upper bounds of the profiler window: Kineto buffers every event of the recorded steps in memory, so
#: memory grows with them; 50 steps is already minutes of a large job.
MAX_PROFILE_STEPS = 50
PROGRESS = ("auto", True, False)  # the console progress line (live.reporter.progress_line)
ATTENTION_FLOPS = ("full", "causal")  # conventions for the attention-score FLOPs (docs/flops.md)


class ConfigError(ValueError):
    """Invalid agent configuration. The message names the field and what is accepted."""


@dataclass
class ModelShape:
    """Shape of a decoder-only transformer, for the analytic FLOP formula (PaLM appendix B).

    ``n_params`` is the number of parameters used in matmuls (embeddings
    excluded); when ``None`` the agent counts the weights of the model's
    ``nn.Linear`` modules. ``seq_len`` ``None`` means: read it from the inputs.
    """

    n_layers: int
    d_model: int
    seq_len: Optional[int] = None
    n_params: Optional[int] = None


@dataclass
class ProfileEvery:
    """Cadence of profiler windows: every ``steps`` optimizer steps or every ``seconds``; both ``None`` = off."""

    steps: Optional[int] = None
    seconds: Optional[float] = None

    @property
    def enabled(self) -> bool:
        return bool(self.steps) or bool(self.seconds)


@dataclass
class AgentConfig:
    """Validated agent configuration. Field comments say why each default was chosen."""

    run: str = ""  # run label on every series; "" = $MFUWATCH_RUN or "<host>-<pid>"
    exporter: bool = True  # serve /metrics over HTTP
    progress: Any = "auto"  # console line per report: "auto" = only when the exporter is off (else nothing shows life)
    port: int = 9478  # base port (+ LOCAL_RANK); 9400 is dcgm-exporter's, 9100 node_exporter's, 9464 OpenTelemetry's
    bind: str = "127.0.0.1"  # loopback by default: metrics of a training job are not for the whole network
    tls_certfile: Optional[str] = None
    tls_keyfile: Optional[str] = None
    file_sd_dir: Optional[str] = None  # write this rank's Prometheus file-SD target file here (multi-node scraping)
    report_every_steps: int = 10  # one measurement per 10 optimizer steps: smooth, and ~0 overhead
    timeline: Optional[str] = None  # JSONL path ("{rank}" is replaced by the rank); "" / None = no timeline
    flops_per_step: Optional[float] = None  # model FLOPs per optimizer step, when the user knows it
    hardware_flops_per_step: Optional[float] = None  # executed FLOPs per step (recomputation included)
    model_shape: Optional[ModelShape] = None  # enables the analytic FLOP formula
    attention_flops: str = "full"  # "full": every (query, key) pair, as PaLM; "causal": only those a causal mask keeps
    flops_convention: Optional[str] = None  # "palm" | "megatron" | "6n" (agent/flops/conventions.py); None = from attention_flops
    tensor_parallel_size: Optional[int] = None  # TP degree for the FLOP model; None = from DTensor meshes ("tp"), else 1
    context_parallel_size: int = 1  # CP degree: each rank's sequence is 1/CP of the attended one
    tokens_per_step: Optional[int] = None  # overrides counting tokens from the model's inputs
    peak_flops: Optional[float] = None  # FLOP/s of one device for the training dtype; overrides the table
    dtype: Optional[str] = None  # training dtype override: one of DTYPES
    calibrate: bool = False  # measure the peak with a large matmul instead of the datasheet table
    nvml: bool = True
    nvml_interval_seconds: float = 1.0  # 1 Hz; the cost of one sample: docs/nvml.md
    profile_every: ProfileEvery = field(default_factory=lambda: ProfileEvery(seconds=300.0))  # a window each 5 min
    profile_warmup_steps: int = 1
    profile_active_steps: int = 3
    top_k_ops: int = 8  # bounded cardinality of op_gpu_time_share_ratio{op}
    alerts: Any = None  # None/True = built-in rules + console; False = off; dict or path = alert config
    rank: int = 0  # from RANK
    local_rank: int = 0  # from LOCAL_RANK
    world_size: int = 1  # from WORLD_SIZE
    # --- fleet (validated by agent/fleet/config.py) ---
    job: str = ""  # `job` label; "" = $MFUWATCH_JOB, Slurm job id, Kubernetes job name, else the run
    hang_watchdog: bool = True  # find stuck steps and record the training thread's stack (never kills)
    hang_factor: float = 5.0  # a step longer than 5x the recent median is stuck: far outside normal jitter
    hang_floor_seconds: float = 60.0  # ...and longer than a minute: short steps jitter by whole seconds on busy hosts
    goodput_warmup_steps: int = 2  # the first steps compile, allocate and warm caches: warm-up, not productive
    auto_checkpoint_phases: bool = True  # time torch.save/load and torch.distributed.checkpoint as checkpoint phases
    otlp_endpoint: Optional[str] = None  # also export over OTLP/HTTP (extra `otlp`), e.g. http://collector:4318/v1/metrics
    # --- exporter hardening and preemption (validated by agent/live/settings.py) ---
    exporter_auth: Optional[Dict[str, Any]] = None  # bearer token or basic auth; names where the secret is (env/file)
    exporter_max_connections: int = 256  # open scrape connections at most: the oldest idle one goes past it
    exporter_read_timeout_seconds: float = 10.0  # Prometheus' default scrape timeout: a request takes at most this
    tls_handshake_timeout_seconds: float = 5.0  # a TLS client that stays silent is dropped after this
    exporter_render_interval_seconds: float = 0.5  # exposition rendered at most 2x a second (and per report)
    exporter_max_cpu_share: float = 0.03  # the server loop's CPU time at most 3% of wall time, however many clients
    exporter_server: str = "process"  # "process": a server child answers scrapes (no GIL time); "thread": in-process
    exporter_server_cpus: Any = None  # the server child's CPUs ([11], "8-11"); null: the training process's affinity
    preemption_signals: Any = field(default_factory=lambda: ["SIGTERM"])  # close, then the previous handler
    preemption_timeout_seconds: float = 2.0  # the close on a signal takes at most this; Slurm/K8s grace is >= 30 s

    @property
    def exporter_port(self) -> int:
        """The port this rank's exporter serves on: ``port + local_rank`` (0 stays 0: any free port).

        Raises ValueError when the sum is past 65535 (:func:`mfuwatch.agent.distributed.exporter_port`).
        """
        return exporter_port(self.port, self.local_rank)

    def to_dict(self) -> Dict[str, Any]:
        """Plain-data dump (for the timeline and logs). Holds no secrets: alert URLs live in the environment."""
        d = dataclasses.asdict(self)
        if isinstance(self.alerts, (dict, list)):
            d["alerts"] = "<alert config>"
        return d


_FIELDS = {f.name: f for f in dataclasses.fields(AgentConfig)}


def _nearest(key: str, choices) -> str:
    m = difflib.get_close_matches(key, list(choices), n=1, cutoff=0.5)
    return f" (did you mean {m[0]!r}?)" if m else ""


def parse_profile_every(value: Any) -> ProfileEvery:
    """Parse ``"500 steps"``, ``"300s"``, ``"5 min"``, an int (steps), or ``0``/``"off"``/``False``.

    Raises:
        ConfigError: naming ``profile_every`` and the accepted forms.
    """
    if isinstance(value, ProfileEvery):
        return value
    if value in (0, None, False, "off", "0", ""):
        return ProfileEvery()
    if isinstance(value, bool):
        raise ConfigError("profile_every: expected e.g. '500 steps', '300s', '5 min' or 'off', got True")
    if isinstance(value, str) and value.strip().isdigit():  # "500" from a command line: steps
        value = int(value)
    if isinstance(value, int) and value > 0:
        return ProfileEvery(steps=value)
    if isinstance(value, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*steps?\s*", value)
        if m:
            n = float(m.group(1))
            if n != int(n):
                raise ConfigError(f"profile_every: steps must be a whole number, got {value!r}")
            if n > 0:
                return ProfileEvery(steps=int(n))
        else:
            from mfuwatch.alerts.validation import parse_duration  # the one duration grammar of both files

            try:
                seconds = parse_duration(value, "profile_every")
            except ValueError:
                seconds = 0.0
            if seconds > 0:
                return ProfileEvery(seconds=seconds)
    raise ConfigError(
        f"profile_every: expected e.g. '500 steps', '300s', '5 min', a positive integer (steps) or 'off', got {value!r}"
    )


def _check_bind_local(bind: str, infos: list) -> None:
    """Raise :class:`ConfigError` when ``bind`` resolves only to addresses this machine does not have
    (``EADDRNOTAVAIL`` from a trial bind to port 0: e.g. another host's IP), which the exporter would
    otherwise meet later, on its own thread or child. Other bind errors are left to the exporter."""
    import errno
    import socket

    not_here = 0
    for family, stype, proto, _name, addr in infos:
        s = socket.socket(family, stype, proto)
        try:
            s.bind((addr[0], 0) + tuple(addr[2:]))
            return
        except OSError as exc:
            if exc.errno != errno.EADDRNOTAVAIL:
                return
            not_here += 1
        finally:
            s.close()
    if not_here:
        raise ConfigError(f"bind: {bind!r} is not an address of this machine (cannot assign it); expected "
                          "'127.0.0.1', '0.0.0.0', '::' or one of this machine's own addresses or host names")


def _check_type(name: str, value: Any, types: Tuple[type, ...], what: str) -> None:
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        raise ConfigError(f"{name}: expected {what}, got {value!r} ({type(value).__name__})")


def _validate(cfg: AgentConfig) -> AgentConfig:
    # run label
    _check_type("run", cfg.run, (str,), "a string")
    if not cfg.run:  # $MFUWATCH_RUN, else one name shared by all ranks of a torchrun/Slurm job
        try:
            cfg.run = default_run_name()
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    _check_type("exporter", cfg.exporter, (bool,), "true or false")
    if cfg.progress not in PROGRESS or not isinstance(cfg.progress, (bool, str)):
        raise ConfigError(f"progress: expected 'auto' (a console line per report when the exporter is off), "
                          f"true or false, got {cfg.progress!r}")
    _check_type("port", cfg.port, (int,), "an integer port 0..65535 (0 = any free port)")
    if not 0 <= cfg.port <= 65535:
        raise ConfigError(f"port: expected 0..65535 (0 = any free port), got {cfg.port}")
    if cfg.port and cfg.port + cfg.local_rank > 65535:
        raise ConfigError(f"port: base port {cfg.port} + LOCAL_RANK {cfg.local_rank} passes 65535; expected a base "
                          "port such that port + local rank <= 65535")
    _check_type("bind", cfg.bind, (str,), "an address such as '127.0.0.1' or '0.0.0.0'")
    if cfg.exporter:
        import socket

        try:
            infos = socket.getaddrinfo(cfg.bind, None, type=socket.SOCK_STREAM)
        except OSError:
            raise ConfigError(f"bind: cannot resolve {cfg.bind!r}; expected an address such as '127.0.0.1', "
                              "'0.0.0.0' or a host name of this machine") from None
        _check_bind_local(cfg.bind, infos)
    if (cfg.tls_certfile is None) != (cfg.tls_keyfile is None):
        raise ConfigError("tls_certfile / tls_keyfile: give both or neither")
    for name in ("tls_certfile", "tls_keyfile"):
        v = getattr(cfg, name)
        if v is not None and not Path(v).is_file():
            raise ConfigError(f"{name}: file not found: {v}")
    if cfg.tls_certfile is not None:
        import ssl

        try:  # the exporter would otherwise fail later, on its own thread, and serve nothing
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cfg.tls_certfile, cfg.tls_keyfile)
        except (ssl.SSLError, OSError, ValueError) as exc:
            raise ConfigError(f"tls_certfile / tls_keyfile: cannot load {cfg.tls_certfile} with {cfg.tls_keyfile} "
                              f"({type(exc).__name__}: {getattr(exc, 'reason', None) or exc}); expected a PEM "
                              "certificate and its matching PEM private key") from None
    _check_type("report_every_steps", cfg.report_every_steps, (int,), "a positive integer")
    if cfg.report_every_steps < 1:
        raise ConfigError(f"report_every_steps: expected a positive integer, got {cfg.report_every_steps}")
    if cfg.file_sd_dir is not None:
        _check_type("file_sd_dir", cfg.file_sd_dir, (str, Path), "a directory path or null")
        cfg.file_sd_dir = str(cfg.file_sd_dir) or None
    if cfg.timeline is not None:
        _check_type("timeline", cfg.timeline, (str, Path), "a file path or null")
        cfg.timeline = str(cfg.timeline).replace("{rank}", str(cfg.rank)) or None  # one file per rank of a job
    for name in ("flops_per_step", "hardware_flops_per_step", "peak_flops"):
        v = getattr(cfg, name)
        if v is not None:
            if isinstance(v, str):  # YAML 1.1 reads "1e12" (no dot) as a string
                try:
                    v = float(v)
                except ValueError:
                    pass
            _check_type(name, v, (int, float), "a positive number or null (e.g. 1.0e12)")
            if not (v > 0 and v != float("inf")):  # NaN fails both; an infinite peak would read as MFU 0
                raise ConfigError(f"{name}: expected a positive finite number or null (e.g. 1.0e12), got {v}")
            setattr(cfg, name, float(v))
    if cfg.tokens_per_step is not None:
        _check_type("tokens_per_step", cfg.tokens_per_step, (int,), "a positive integer or null")
        if cfg.tokens_per_step < 1:
            raise ConfigError(f"tokens_per_step: expected a positive integer or null, got {cfg.tokens_per_step}")
    if cfg.model_shape is not None and not isinstance(cfg.model_shape, ModelShape):
        ms = cfg.model_shape
        if not isinstance(ms, Mapping):
            raise ConfigError("model_shape: expected a mapping with n_layers, d_model[, seq_len, n_params]")
        allowed = {f.name for f in dataclasses.fields(ModelShape)}
        for k in ms:
            if k not in allowed:
                raise ConfigError(f"model_shape.{k}: unknown key{_nearest(k, allowed)}; accepted: {sorted(allowed)}")
        for k in ("n_layers", "d_model"):
            if k not in ms:
                raise ConfigError(f"model_shape.{k}: required")
        for k, v in ms.items():
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ConfigError(f"model_shape.{k}: expected a positive integer, got {v!r}")
        cfg.model_shape = ModelShape(**ms)
    if cfg.attention_flops not in ATTENTION_FLOPS:
        raise ConfigError(f"attention_flops: expected one of {', '.join(ATTENTION_FLOPS)}, got {cfg.attention_flops!r}")
    from .flops.conventions import ATTENTION_OF, CONVENTIONS

    if cfg.flops_convention is None:
        cfg.flops_convention = "megatron" if cfg.attention_flops == "causal" else "palm"
    elif cfg.flops_convention not in CONVENTIONS:
        raise ConfigError(f"flops_convention: expected one of {', '.join(CONVENTIONS)}, got {cfg.flops_convention!r}"
                          f"{_nearest(str(cfg.flops_convention).lower(), CONVENTIONS)}")
    elif cfg.attention_flops == "causal" and cfg.flops_convention != "megatron":
        raise ConfigError(f"attention_flops: 'causal' contradicts flops_convention {cfg.flops_convention!r}; "
                          "expected flops_convention 'megatron' (causal pairs) or no attention_flops")
    cfg.attention_flops = ATTENTION_OF[cfg.flops_convention]
    for name in ("tensor_parallel_size", "context_parallel_size"):
        v = getattr(cfg, name)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ConfigError(f"{name}: expected a positive integer{' or null' if name.startswith('t') else ''}, "
                              f"got {v!r}")
    if cfg.dtype is not None and cfg.dtype not in DTYPES:
        raise ConfigError(f"dtype: expected one of {', '.join(DTYPES)} or null, got {cfg.dtype!r}")
    for name in ("calibrate", "nvml"):
        _check_type(name, getattr(cfg, name), (bool,), "true or false")
    _check_type("nvml_interval_seconds", cfg.nvml_interval_seconds, (int, float), "a number of seconds >= 0.05")
    if cfg.nvml_interval_seconds < 0.05:
        raise ConfigError(f"nvml_interval_seconds: expected >= 0.05, got {cfg.nvml_interval_seconds}")
    cfg.profile_every = parse_profile_every(cfg.profile_every)
    for name, lo, hi in (("profile_warmup_steps", 0, MAX_PROFILE_STEPS), ("profile_active_steps", 1, MAX_PROFILE_STEPS),
                         ("top_k_ops", 1, 100)):
        v = getattr(cfg, name)
        if isinstance(v, float) and v.is_integer() and lo <= v <= hi:
            v = int(v)
            setattr(cfg, name, v)
        _check_type(name, v, (int,), f"an integer {lo}..{hi}")
        if not lo <= v <= hi:
            raise ConfigError(f"{name}: expected an integer {lo}..{hi} (the profiler holds every event of the "
                              f"window in memory), got {v}" if name != "top_k_ops" else
                              f"{name}: expected an integer {lo}..{hi} (one series per op), got {v}")
    if cfg.alerts is not None and not isinstance(cfg.alerts, (bool, dict, str, Path)):
        raise ConfigError(f"alerts: expected true/false, a mapping, or a path to an alert-rules YAML, got {cfg.alerts!r}")
    for name in ("rank", "local_rank", "world_size"):
        _check_type(name, getattr(cfg, name), (int,), "a non-negative integer")
    if cfg.world_size < 1 or not 0 <= cfg.rank < cfg.world_size:
        raise ConfigError(f"rank/world_size: expected 0 <= rank < world_size, got rank={cfg.rank} world_size={cfg.world_size}")
    from .fleet.config import validate_fleet  # fleet settings (job label, watchdog, goodput, OTLP)

    validate_fleet(cfg, ConfigError)
    from .live.settings import validate_live  # exporter auth/limits, preemption signals

    validate_live(cfg, ConfigError)
    try:
        cfg.exporter_port  # noqa: B018 - base port + local rank must be a port
    except ValueError as exc:
        raise ConfigError(f"port: {exc}") from None
    return cfg


def user_settings(config: Union[None, str, Path, Mapping[str, Any], AgentConfig]) -> Dict[str, Any]:
    """The settings the user wrote, as a plain dict: a YAML file's mapping, a mapping, or an ``AgentConfig``.

    ``None`` reads the file named by ``$MFUWATCH_CONFIG`` if set, else gives ``{}``.

    Raises:
        ConfigError: unreadable or malformed YAML file, or a value of another type.
    """
    if config is None:
        config = os.environ.get("MFUWATCH_CONFIG") or None
    if config is None:
        return {}
    if isinstance(config, AgentConfig):
        d = dataclasses.asdict(config)
        d["model_shape"] = config.model_shape  # keep the dataclasses, not their dict forms
        d["profile_every"] = config.profile_every
        return d
    if isinstance(config, Mapping):
        return dict(config)
    if not isinstance(config, (str, Path)):
        raise ConfigError(f"config: expected a path, a mapping or an AgentConfig, got {type(config).__name__}")
    path = Path(config)
    try:
        loaded = yaml.safe_load(path.read_text()) or {}
    except OSError as exc:
        raise ConfigError(f"config: cannot read {path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config: {path} is not valid YAML: {exc}") from None
    if not isinstance(loaded, Mapping):
        raise ConfigError(f"config: {path} must hold a mapping of settings, got {type(loaded).__name__}")
    loaded = dict(loaded)
    alerts = loaded.get("alerts")
    if isinstance(alerts, str) and not Path(alerts).is_absolute():
        # a rules file named in a config file is found beside it, as `mfuwatch alerts check` does
        loaded["alerts"] = str(path.parent / alerts)
    return loaded


def load_config(config: Union[None, str, Path, Mapping[str, Any], AgentConfig] = None, **overrides: Any) -> AgentConfig:
    """Build a validated :class:`AgentConfig`.

    Args:
        config: a path to a YAML file, a mapping, an ``AgentConfig``, or ``None``
            (then ``$MFUWATCH_CONFIG`` is read if set).
        **overrides: keyword arguments, applied last.

    Raises:
        ConfigError: unknown key (with the nearest valid key), bad value (with the
            accepted values), unreadable or malformed YAML file.
    """
    try:
        rank, local_rank, world_size = rank_from_env()
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    data: Dict[str, Any] = {"rank": rank, "local_rank": local_rank, "world_size": world_size}
    data.update(user_settings(config))
    data.update(overrides)
    for key in data:
        if key not in _FIELDS:
            raise ConfigError(f"{key}: unknown setting{_nearest(key, _FIELDS)}; accepted: {', '.join(sorted(_FIELDS))}")
    return _validate(AgentConfig(**data))
