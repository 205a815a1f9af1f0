"""DispatcherConfig and WorkerConfig: TF's field names, defaults and time rules.

Time fields follow TF: ``None`` leaves the choice to the runtime (stored as
0) and an explicit 0 means "as small as possible" (stored as 1). The runtime
defaults (``runtime_ms``) are TF's. ``allow_cloudpickle``, the
dispatcher's ``bind_address``, the worker's ``function_modules`` and ``readable_dirs`` and
both servers' security fields (``tls_cert_file``, ``tls_key_file``, ``tls_ca_file``,
``tls_client_auth``, ``auth_token_file``: as ``Server``'s, see ``clusterwire.security``) and
their ``metrics_port`` and ``metrics_host`` (as ``Server``'s: an HTTP endpoint of the
process's metrics, see ``clusterwire.metrics``) and their ``worker_token_file`` (the secret
only workers hold, see ``clusterwire.data.worker_auth``) are clusterwire additions.
"""

from __future__ import annotations

import collections
import logging
from typing import Any

from clusterwire import errors
from clusterwire.addressing import split_host_port, split_target
from clusterwire.data.addresses import dispatcher_addresses
from clusterwire.data.limits import PipelineLimits, as_limits
from clusterwire.data.quotas import ServiceLimits, as_service_limits
from clusterwire.plugins import get_plugin_manager
from clusterwire.security import Security, load_security, security_fields
from clusterwire.shell import listen_options
from clusterwire.transport import ListenOptions

log = logging.getLogger("clusterwire")

#: Threads of a dispatcher's or worker's listener.
_DATA_MAX_WORKERS = 32

# Runtime defaults for time fields left at None.
JOB_GC_CHECK_INTERVAL_MS = 10 * 60 * 1000
JOB_GC_TIMEOUT_MS = 5 * 60 * 1000
WORKER_TIMEOUT_MS = 60 * 1000
CLIENT_TIMEOUT_MS = 2 * 60 * 1000
HEARTBEAT_INTERVAL_MS = 30 * 1000
DISPATCHER_TIMEOUT_MS = 60 * 60 * 1000
DATASET_GC_TIMEOUT_MS = 60 * 60 * 1000
#: TF's cross-trainer cache window: the most a job's cache takes when
#: ``cross_trainer_cache_size_bytes`` is None (see ``cross_trainer_cache.cache_plan``).
CROSS_TRAINER_CACHE_SIZE_BYTES = 10 << 30


def time_field(value: Any, name: str) -> int:
    """TF's mapping of a time argument: None -> 0 (runtime default), 0 -> 1."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"`{name}` must be an int number of milliseconds, got {value!r}")
    return 1 if value == 0 else value


def runtime_ms(value: int, default: int) -> int:
    """A stored time field as the runtime uses it (0 -> ``default``)."""
    return default if value == 0 else value


def _port(value: Any, name: str = "port") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 65535:
        raise ValueError(f"`{name}` must be an int in 0..65535, got {value!r}")
    return value


def _metrics(port: Any, host: Any) -> tuple[int | None, str]:
    """``metrics_port`` (None: no endpoint; 0: a free port) and ``metrics_host`` (None:
    127.0.0.1) as stored."""
    if port is not None:
        _port(port, "metrics_port")
    if host is not None and (not isinstance(host, str) or not host):
        raise ValueError(f"`metrics_host` must be a non-empty string, got {host!r}")
    return port, host or "127.0.0.1"


_DISPATCHER_FIELDS = ("port", "protocol", "work_dir", "fault_tolerant_mode", "worker_addresses",
                      "job_gc_check_interval_ms", "job_gc_timeout_ms", "worker_timeout_ms",
                      "allow_cloudpickle", "bind_address", "dataset_gc_timeout_ms",
                      "metrics_port", "metrics_host", "worker_token_file", "standby",
                      "limits", *security_fields())
_WORKER_FIELDS = ("dispatcher_address", "worker_address", "port", "protocol",
                  "heartbeat_interval_ms", "dispatcher_timeout_ms", "data_transfer_protocol",
                  "data_transfer_address", "allow_cloudpickle", "function_modules",
                  "readable_dirs", "send_tracebacks", "cross_trainer_cache_size_bytes",
                  "metrics_port", "metrics_host", "worker_token_file", "pipeline_limits",
                  "limits", *security_fields())


def _token_file(value: Any) -> str | None:
    """``worker_token_file`` as stored: None (the environment's, else none) or a path."""
    if value is not None and (not isinstance(value, str) or not value):
        raise ValueError(f"`worker_token_file` must be a non-empty path string (or None), "
                         f"got {value!r}")
    return value


def _security(settings: dict[str, Any]) -> tuple[Any, ...]:
    """The security fields' values in field order; TypeError naming an unknown one."""
    unknown = set(settings) - set(security_fields())
    if unknown:
        raise TypeError(f"Unknown config field(s) {sorted(unknown)}; the security fields are "
                        f"{', '.join(security_fields())}.")
    return tuple(settings.get(name) for name in security_fields())


def _names(value: Any, name: str) -> tuple[str, ...]:
    """A list of names or paths as a tuple; ValueError for a bare string or a non-string."""
    if isinstance(value, str) or not all(isinstance(v, str) and v for v in value):
        raise ValueError(f"`{name}` must be a list of non-empty strings, got {value!r}")
    return tuple(value)


def _cache_size(value: Any) -> int:
    """``cross_trainer_cache_size_bytes`` as stored: None -> 0 (TF's default at run time)."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"`cross_trainer_cache_size_bytes` must be a positive int number of "
                         f"bytes (or None for a share of the worker's memory), got {value!r}")
    return value


class DispatcherConfig(collections.namedtuple("DispatcherConfig", _DISPATCHER_FIELDS)):
    """Configuration of a DispatchServer (``tf.data.experimental.service.DispatcherConfig``).

    ``work_dir`` holds the journal and dataset payloads; ``fault_tolerant_mode``
    journals state there (fsync'd) so a restarted dispatcher continues.
    ``worker_addresses`` fixes the workers for static sharding.
    ``job_gc_timeout_ms=-1`` never collects jobs. ``bind_address`` is the host
    the dispatcher binds ("localhost"; "0.0.0.0" for every IPv4 interface).
    ``dataset_gc_timeout_ms``: a registered dataset no job has used for this long is
    collected (memory, payload file, journal records); None: one hour; -1: never.
    ``metrics_port``: serve the process's metrics over HTTP there (0: a free port; None: no
    endpoint), bound to ``metrics_host`` (default 127.0.0.1) and protected by the
    dispatcher's security (``DispatchServer.metrics_url``).
    ``worker_token_file``: the file holding the secret workers present to register (see
    ``clusterwire.data.worker_auth``); None: ``CLUSTERWIRE_WORKER_TOKEN_FILE`` or
    ``CLUSTERWIRE_WORKER_TOKEN``, else a random token only this process's workers and
    ``LocalDataService``'s learn.
    ``standby``: wait for the work_dir's lease (``clusterwire.data.lease``) while another
    dispatcher holds it, then replay the journal and serve at this one's own address (needs
    ``work_dir`` and ``fault_tolerant_mode``). Without it, a dispatcher whose work_dir's
    lease is held is refused (FailedPreconditionError).
    ``limits``: the data service's quotas: a ``clusterwire.data.ServiceLimits``, or a dict of
    some of its fields (over plugins.toml's ``[data_limits]``, over the defaults), or None
    (plugins.toml's, else the defaults); see ``server_limits``. The dispatcher applies the
    dataset, job, hand-out and merge ones.
    """

    def __new__(cls, port: int = 0, protocol: str | None = None, work_dir: str | None = None,
                fault_tolerant_mode: bool = False, worker_addresses: list[str] | None = None,
                job_gc_check_interval_ms: int | None = None,
                job_gc_timeout_ms: int | None = None, worker_timeout_ms: int | None = None,
                allow_cloudpickle: bool = False, bind_address: str = "localhost",
                dataset_gc_timeout_ms: int | None = None, metrics_port: int | None = None,
                metrics_host: str | None = None, worker_token_file: str | None = None,
                standby: bool = False, limits: ServiceLimits | dict | None = None,
                **security: Any):
        if standby and not (work_dir and fault_tolerant_mode):
            raise errors.InvalidArgumentError(
                f"A standby dispatcher needs the primary's work_dir and fault_tolerant_mode "
                f"(got work_dir={work_dir!r}, fault_tolerant_mode={fault_tolerant_mode!r}): it "
                "takes over by replaying the primary's journal. Give it the same --work-dir "
                "and --fault-tolerant-mode as the primary.")
        gc_timeout = -1 if job_gc_timeout_ms == -1 else time_field(
            job_gc_timeout_ms, "job_gc_timeout_ms")
        dataset_gc = -1 if dataset_gc_timeout_ms == -1 else time_field(
            dataset_gc_timeout_ms, "dataset_gc_timeout_ms")
        if worker_addresses is not None:
            worker_addresses = list(worker_addresses)
            for address in worker_addresses:
                split_host_port(address.replace("%port%", "0"))
        return super().__new__(
            cls, _port(port), protocol or "grpc", work_dir, bool(fault_tolerant_mode),
            worker_addresses, time_field(job_gc_check_interval_ms, "job_gc_check_interval_ms"),
            gc_timeout, time_field(worker_timeout_ms, "worker_timeout_ms"),
            bool(allow_cloudpickle), bind_address, dataset_gc,
            *_metrics(metrics_port, metrics_host), _token_file(worker_token_file),
            bool(standby), _limits(limits), *_security(security))


class WorkerConfig(collections.namedtuple("WorkerConfig", _WORKER_FIELDS)):
    """Configuration of a WorkerServer (``tf.data.experimental.service.WorkerConfig``).

    ``dispatcher_address``: ``host:port``, or a primary's and its standbys' as
    ``"host1:port1,host2:port2"`` (the worker follows the one serving).
    ``worker_address`` is what the dispatcher tells clients (``%port%`` is
    replaced by the bound port); the worker binds its host.
    ``data_transfer_protocol`` serves elements over a second transport at
    ``data_transfer_address`` (``%dts_port%``: its bound port).
    ``function_modules``: modules whose module-level functions the worker may run (besides
    ``@clusterwire.data.function`` ones); ``readable_dirs``: the only directories
    and URL prefixes the worker's readers may read under (see
    ``clusterwire.data.filesystems``).
    ``send_tracebacks``: pipeline errors carry the worker's traceback to clients.
    ``cross_trainer_cache_size_bytes``: the bytes each job's cross-trainer cache keeps on
    this worker (see ``clusterwire.data.CrossTrainerCache``); None (stored as 0): a quarter
    of the worker's caches' share of its memory (an eighth), at most TF's 10 GiB. A worker
    caches as many jobs at once as that share holds (``cross_trainer_cache.cache_plan``).
    ``metrics_port`` and ``metrics_host``: as the DispatcherConfig's
    (``WorkerServer.metrics_url``).
    ``worker_token_file``: the dispatcher's worker token, presented with every heartbeat;
    None: ``CLUSTERWIRE_WORKER_TOKEN_FILE`` or ``CLUSTERWIRE_WORKER_TOKEN``, else the token
    of a dispatcher in this process.
    ``pipeline_limits``: what the pipelines clients send may make this worker spawn and hold
    (a ``clusterwire.data.PipelineLimits`` or a dict of its fields; None: its defaults).
    ``limits``: the data service's quotas (as the DispatcherConfig's); the worker applies the
    stream, idle-time and removed-job ones.
    """

    def __new__(cls, dispatcher_address: str | None = None, worker_address: str | None = None,
                port: int = 0, protocol: str | None = None,
                heartbeat_interval_ms: int | None = None,
                dispatcher_timeout_ms: int | None = None,
                data_transfer_protocol: str | None = None,
                data_transfer_address: str | None = None, allow_cloudpickle: bool = False,
                function_modules: Any = (), readable_dirs: Any = (),
                send_tracebacks: bool = False, cross_trainer_cache_size_bytes: int | None = None,
                metrics_port: int | None = None, metrics_host: str | None = None,
                worker_token_file: str | None = None,
                pipeline_limits: PipelineLimits | dict | None = None,
                limits: ServiceLimits | dict | None = None, **security: Any):
        if dispatcher_address is None:
            raise ValueError("Must specify a `dispatcher_address`.")
        if not isinstance(dispatcher_address, str) or not dispatcher_address:
            raise ValueError(f"`dispatcher_address` must be a non-empty string, got "
                             f"{dispatcher_address!r}")
        dispatcher_addresses(split_target(dispatcher_address)[1])
        worker_address = worker_address or "localhost:%port%"
        split_host_port(worker_address.replace("%port%", "0"))
        return super().__new__(
            cls, dispatcher_address, worker_address, _port(port), protocol or "grpc",
            time_field(heartbeat_interval_ms, "heartbeat_interval_ms"),
            time_field(dispatcher_timeout_ms, "dispatcher_timeout_ms"),
            data_transfer_protocol, data_transfer_address or "localhost:%dts_port%",
            bool(allow_cloudpickle), _names(function_modules, "function_modules"),
            _names(readable_dirs, "readable_dirs"), bool(send_tracebacks),
            _cache_size(cross_trainer_cache_size_bytes), *_metrics(metrics_port, metrics_host),
            _token_file(worker_token_file), as_limits(pipeline_limits),
            _limits(limits), *_security(security))


def _limits(value: Any) -> ServiceLimits | dict | None:
    """``limits`` as stored: a ServiceLimits, or the dict given (checked), or None."""
    as_service_limits(value)
    return dict(value) if isinstance(value, dict) else value


def server_limits(config: Any) -> ServiceLimits:
    """The ServiceLimits of a DispatcherConfig or WorkerConfig: its ``limits`` if a
    ServiceLimits, else its dict of fields over plugins.toml's ``[data_limits]`` over the
    defaults."""
    if isinstance(config.limits, ServiceLimits):
        return config.limits
    table, path = get_plugin_manager().data_limits()
    try:
        as_service_limits(table)
    except errors.InvalidArgumentError as err:
        raise errors.InvalidArgumentError(
            f"{path} [data_limits]: {err.message} Fix it there.") from None
    return as_service_limits({**table, **(config.limits or {})})


def as_config(config: Any, cls: type) -> Any:
    """``config`` as ``cls`` (a DispatcherConfig/WorkerConfig, a dict of fields, or None)."""
    if config is None:
        return None
    if isinstance(config, cls):
        return config
    if isinstance(config, dict):
        return cls(**config)
    raise TypeError(f"config must be a {cls.__name__} or a dict of its fields, got "
                    f"{type(config).__name__}")


def warn_if_unsafe(config: Any, what: str) -> None:
    """Log a warning when ``config`` lets clients run pickled code (allow_cloudpickle)."""
    if config.allow_cloudpickle:
        log.warning("clusterwire: WARNING: the tf.data service %s allows cloudpickle: workers "
                    "run pickled code sent by any client that reaches the dispatcher.", what)


def server_security(config: Any) -> Security:
    """The Security a DispatcherConfig or WorkerConfig asks for (merged over the
    ``CLUSTERWIRE_*`` environment and plugins.toml's ``[security]``, as ``Server``'s)."""
    return load_security({name: getattr(config, name) for name in security_fields()})


def server_listen_options(security: Security) -> ListenOptions:
    """The listener options of a data-service server."""
    return listen_options(max_workers=_DATA_MAX_WORKERS, security=security)
