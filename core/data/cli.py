"""The ``clusterwire dispatcher`` and ``clusterwire worker`` commands.

Each runs one data-service server as a dedicated process until SIGINT or
SIGTERM, printing ``CLUSTERWIRE_READY <target>`` on stdout once it serves
(the worker's target is its worker address; a worker prints it once its dispatcher has
accepted it, saying on stderr meanwhile what it waits for), and a "stopped" line on stderr
when a signal stopped it.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import signal
import sys
import threading
import time
from typing import Any

from clusterwire import errors
from clusterwire.data.config import DispatcherConfig, WorkerConfig
from clusterwire.data.dispatcher import DispatchServer
from clusterwire.data.limits import PipelineLimits
from clusterwire.data.quotas import limits_help, parse_limit
from clusterwire.data.worker import WorkerServer
from clusterwire.durations import format_duration
from clusterwire.local_cluster import await_ready
from clusterwire.ready_line import READY_PREFIX, say_ready
from clusterwire.security import security_fields
from clusterwire.terminal_text import printable

__all__ = ["READY_PREFIX", "add_commands", "await_ready", "import_modules"]

#: A worker its dispatcher has not accepted says so when ``start()`` returns (after 5 s),
#: again this long later, then at doubling intervals up to WAITING_REPORT_MAX_S.
WAITING_REPORT_FIRST_S = 10.0
WAITING_REPORT_MAX_S = 600.0
#: A worker's jemalloc decay (see use_jemalloc_for_arrow): jemalloc's default, not Arrow's 1 s.
_JEMALLOC_DECAY = "dirty_decay_ms:10000,muzzy_decay_ms:10000"


def import_modules(command: str, modules: list[str]) -> None:
    """Import the ``--import`` modules, finding them in the current directory too (as
    ``python -m`` does); SystemExit naming the module otherwise."""
    if modules and os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as err:
            raise SystemExit(f"clusterwire {command}: cannot --import {module!r}: {err} "
                             f"(searched the current directory, {os.getcwd()}, and "
                             "PYTHONPATH)") from None


def _stop_on_signals(server: Any, args: argparse.Namespace) -> threading.Event:
    """SIGINT and SIGTERM stop ``server`` (within ``--grace``); the event says one came."""
    signalled = threading.Event()

    def on_signal(_signum: int, _frame: Any) -> None:
        signalled.set()
        threading.Thread(target=server.stop, args=(args.grace,), daemon=True).start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return signalled


def _serve_until_signal(server: Any, target: str, what: str, args: argparse.Namespace) -> int:
    say_ready(target)
    if not args.quiet:
        metrics = f", metrics at {server.metrics_url}" if server.metrics_url else ""
        print(f"clusterwire: tf.data service {what} serving at {target}{metrics}",
              file=sys.stderr, flush=True)
    server.join()
    _say_stopped(target, what, args)
    return 0


def _say_stopped(target: str, what: str, args: argparse.Namespace) -> None:
    if not args.quiet:
        print(f"clusterwire: tf.data service {what} at {target} stopped", file=sys.stderr,
              flush=True)


def _dispatcher(args: argparse.Namespace) -> int:
    import_modules(args.command, args.imports)
    config = DispatcherConfig(
        port=args.port, protocol=args.protocol, work_dir=args.work_dir,
        fault_tolerant_mode=args.fault_tolerant_mode, worker_addresses=args.worker_addresses,
        job_gc_check_interval_ms=args.job_gc_check_interval_ms,
        job_gc_timeout_ms=args.job_gc_timeout_ms, worker_timeout_ms=args.worker_timeout_ms,
        dataset_gc_timeout_ms=args.dataset_gc_timeout_ms,
        allow_cloudpickle=args.allow_cloudpickle, bind_address=args.bind_address,
        worker_token_file=args.worker_token_file, standby=args.standby, limits=_limits(args),
        **_metrics(args), **_security(args))
    server = DispatchServer(config=config)
    _stop_on_signals(server, args)
    if not server.wait_serving():  # a standby stopped by a signal before it took over
        _say_stopped(server.target, "standby dispatcher", args)
        return 0
    report = server.journal_report
    if report.message:
        print(f"clusterwire dispatcher: {report.message}", file=sys.stderr, flush=True)
    return _serve_until_signal(server, server.target, "dispatcher", args)


def use_jemalloc_for_arrow(environ: dict[str, str] | os._Environ = os.environ) -> None:
    """A worker process reads Parquet with Arrow's jemalloc pool unless its operator chose one
    (``ARROW_DEFAULT_MEMORY_POOL``; read when pyarrow is first imported, so set first). With
    Arrow's default, mimalloc, a worker handing a row group out over several answers gave its
    pages back and faulted them in again as zeroed 2 MiB huge pages: twice the CPU per MB
    (BENCHMARKS, Data files). Linux only: the pyarrow wheels elsewhere may lack jemalloc.

    With that pool, jemalloc keeps freed pages for jemalloc's own default of 10 s
    (``JE_ARROW_MALLOC_CONF``, unless the operator set it) where Arrow asks for 1 s: Parquet's
    decode grows each batch's column buffers by reallocation, and with 1 s those new extents
    were mostly pages already given back, faulted in and zeroed again."""
    if sys.platform == "linux":
        environ.setdefault("ARROW_DEFAULT_MEMORY_POOL", "jemalloc")
        if environ["ARROW_DEFAULT_MEMORY_POOL"] == "jemalloc":
            environ.setdefault("JE_ARROW_MALLOC_CONF", _JEMALLOC_DECAY)


def _worker(args: argparse.Namespace) -> int:
    use_jemalloc_for_arrow()
    import_modules(args.command, args.imports)
    config = WorkerConfig(
        dispatcher_address=args.dispatcher_address, worker_address=args.worker_address,
        port=args.port, protocol=args.protocol, heartbeat_interval_ms=args.heartbeat_interval_ms,
        dispatcher_timeout_ms=args.dispatcher_timeout_ms,
        data_transfer_protocol=args.data_transfer_protocol,
        data_transfer_address=args.data_transfer_address,
        allow_cloudpickle=args.allow_cloudpickle, function_modules=args.function_modules,
        readable_dirs=args.readable_dirs, send_tracebacks=args.send_tracebacks,
        cross_trainer_cache_size_bytes=args.cross_trainer_cache_size_bytes,
        worker_token_file=args.worker_token_file, pipeline_limits=_pipeline_limits(args),
        limits=_limits(args), **_metrics(args), **_security(args))
    server = WorkerServer(config=config, start=False)
    target = f"{config.protocol}://{server.address}"
    signalled = _stop_on_signals(server, args)
    started = time.monotonic()
    server.start()
    if not _await_dispatcher(server, target, config.dispatcher_address, started, signalled):
        server.join()
        _say_stopped(target, "worker", args)
        return 0
    return _serve_until_signal(server, target, "worker", args)


def _await_dispatcher(server: Any, target: str, dispatcher: str, started: float,
                      signalled: threading.Event) -> bool:
    """Wait until the dispatcher accepts the worker (True), saying on stderr every so often
    (at first after ``start()``'s wait, then at doubling intervals up to
    WAITING_REPORT_MAX_S) what it waits for and why; False if a signal stopped it first."""
    interval = WAITING_REPORT_FIRST_S
    while not server.registered:
        if signalled.is_set():
            return False
        problem = server.registration_problem or "no answer yet"
        print(f"clusterwire: tf.data service worker {target} is waiting for its dispatcher at "
              f"{printable(dispatcher)} ({format_duration(time.monotonic() - started)} so "
              f"far): {printable(problem).rstrip('.')}. It serves no elements until the dispatcher "
              "accepts it, and keeps trying.", file=sys.stderr, flush=True)
        if server.wait_registered(interval):
            break
        interval = min(interval * 2, WAITING_REPORT_MAX_S)
    return not signalled.is_set()


def _pipeline_limits(args: argparse.Namespace) -> dict[str, int]:
    """The PipelineLimits fields given as ``--max-...`` flags."""
    names = (f.name for f in dataclasses.fields(PipelineLimits))
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}


def _limits(args: argparse.Namespace) -> dict[str, int | float]:
    """The ServiceLimits given as ``--limit NAME=VALUE`` (InvalidArgumentError for a bad
    one)."""
    return dict(parse_limit(text, args.command) for text in args.limits)


def add_metrics_arguments(parser: argparse.ArgumentParser) -> None:
    """``--metrics-port`` and ``--metrics-host``, as every server command has them."""
    parser.add_argument("--metrics-port", type=int, metavar="N",
                        help="serve /metrics, /healthz and /readyz over HTTP on port N (0: a "
                             "free one; the banner gives the URL; protected like the server); "
                             "needs prometheus_client")
    parser.add_argument("--metrics-host", metavar="HOST",
                        help="interface of the metrics endpoint (default 127.0.0.1)")


def check_metrics_arguments(args: argparse.Namespace, port_given: bool = False) -> None:
    """InvalidArgumentError for ``--metrics-host`` without a port (``--metrics-port``, or
    one given otherwise: ``port_given``)."""
    if args.metrics_host is not None and args.metrics_port is None and not port_given:
        raise errors.InvalidArgumentError(
            "--metrics-host without --metrics-port: the endpoint serves only on a port; "
            "add --metrics-port N (0: a free one).")


def _metrics(args: argparse.Namespace) -> dict[str, Any]:
    check_metrics_arguments(args)
    return {"metrics_port": args.metrics_port, "metrics_host": args.metrics_host}


def _security(args: argparse.Namespace) -> dict[str, Any]:
    return {name: getattr(args, name) for name in security_fields()}


def _common(parser: argparse.ArgumentParser, server: str) -> None:
    parser.add_argument("--port", type=int, default=0, help="port to bind (0: a free port)")
    parser.add_argument("--protocol", default="grpc", help="transport protocol (default grpc)")
    parser.add_argument("--allow-cloudpickle", action="store_true",
                        help="UNSAFE: run pickled lambdas sent by any client")
    parser.add_argument("--import", dest="imports", action="append", default=[],
                        metavar="MODULE", help="import MODULE first")
    parser.add_argument("--grace", type=float, default=5.0,
                        help="seconds in-flight requests get at shutdown (default 5)")
    parser.add_argument("--quiet", action="store_true", help="no banner on stderr")
    parser.add_argument("--limit", dest="limits", action="append", default=[],
                        metavar="NAME=VALUE",
                        help=f"set one of the {server}'s limits (ServiceLimits; repeatable; "
                        f"see README Reliability): {limits_help(server)}")
    add_metrics_arguments(parser)
    security = parser.add_argument_group(
        "security", "as Server's; the CLUSTERWIRE_* environment and plugins.toml's [security] "
        "apply too (the token itself only from a file or CLUSTERWIRE_AUTH_TOKEN)")
    security.add_argument("--auth-token-file", metavar="FILE",
                          help="file holding the cluster token every request must carry")
    security.add_argument("--tls-cert-file", metavar="PEM", help="this server's certificate")
    security.add_argument("--tls-key-file", metavar="PEM", help="this server's private key")
    security.add_argument("--tls-ca-file", metavar="PEM", help="CA that checks peers")
    security.add_argument("--tls-client-auth", action="store_true", default=None,
                          help="require client certificates (mutual TLS)")
    security.add_argument("--worker-token-file", metavar="FILE",
                          help="file holding the workers' own secret, which a worker presents "
                          "to register (not the cluster token; also "
                          "CLUSTERWIRE_WORKER_TOKEN_FILE). A dispatcher without one makes a "
                          "random one: only workers of its own process or of its "
                          "LocalDataService can register")


def add_commands(commands: Any) -> None:
    """Add the ``dispatcher`` and ``worker`` subcommands to the clusterwire parser."""
    dispatcher = commands.add_parser(
        "dispatcher", help="run a tf.data service dispatcher until SIGINT/SIGTERM")
    _common(dispatcher, "dispatcher")
    dispatcher.add_argument("--work-dir", help="journal and dataset directory")
    dispatcher.add_argument("--fault-tolerant-mode", action="store_true",
                            help="journal state in --work-dir to survive restarts")
    dispatcher.add_argument("--standby", action="store_true",
                            help="wait while another dispatcher holds --work-dir's lease, then "
                            "replay its journal and serve at this one's --port (needs "
                            "--work-dir and --fault-tolerant-mode; until then every request is "
                            "answered UNAVAILABLE and no ready line is printed). Give workers "
                            "and clients both addresses: HOST1:P1,HOST2:P2")
    dispatcher.add_argument("--worker-addresses", nargs="+", metavar="HOST:PORT",
                            help="fixed workers, for static sharding policies")
    for name in ("job-gc-check-interval-ms", "job-gc-timeout-ms", "worker-timeout-ms",
                 "dataset-gc-timeout-ms"):
        dispatcher.add_argument(f"--{name}", type=int)
    dispatcher.add_argument("--bind-address", default="localhost",
                            help="host to bind (default localhost; 0.0.0.0 for all IPv4)")
    dispatcher.set_defaults(run=_dispatcher)

    worker = commands.add_parser(
        "worker", help="run a tf.data service worker until SIGINT/SIGTERM")
    _common(worker, "worker")
    worker.add_argument("--dispatcher-address", required=True,
                        help="HOST:PORT of the dispatcher, or of a primary and its standbys: "
                        "HOST1:P1,HOST2:P2 (the worker follows the one serving)")
    worker.add_argument("--worker-address", help="address told to clients (default "
                        "localhost:%%port%%)")
    for name in ("heartbeat-interval-ms", "dispatcher-timeout-ms",
                 "cross-trainer-cache-size-bytes"):
        worker.add_argument(f"--{name}", type=int)
    for limit in dataclasses.fields(PipelineLimits):
        worker.add_argument(f"--{limit.name.replace('_', '-')}", type=int, metavar="N",
                            help="a PipelineLimits field: what a client's pipeline may make "
                            "this worker spawn or hold (see README Reliability)")
    worker.add_argument("--data-transfer-protocol", help="second transport for elements")
    worker.add_argument("--data-transfer-address")
    worker.add_argument("--function-module", dest="function_modules", action="append",
                        default=[], metavar="MODULE",
                        help="allow the module-level functions of MODULE in datasets "
                        "(imported at start); @clusterwire.data.function ones of --import "
                        "modules are allowed anyway")
    worker.add_argument("--send-tracebacks", action="store_true",
                        help="pipeline errors carry the worker's traceback to clients")
    worker.add_argument("--readable-dir", dest="readable_dirs", action="append", default=[],
                        metavar="DIR_OR_URL", help="a directory or URL prefix (s3://bucket/"
                        "train) the worker's readers may read under; repeatable (none by "
                        "default: every file is refused)")
    worker.set_defaults(run=_worker)
