"""The ``clusterwire`` command: serve, resolve, status, top, plugins, demo, dispatcher, worker."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
from typing import Any

from clusterwire import __version__, errors
from clusterwire.addressing import is_loopback  # noqa: F401 - re-exported for the CLI's users
from clusterwire.protos.tensorflow_server_pb2 import ServerOptions
from clusterwire.security_flags import add_security_arguments, security_options
from clusterwire.terminal_text import LOG_CHARS, printable


def _json_arg(text: str, what: str) -> Any:
    """Parse JSON given inline or as ``@file``."""
    try:
        if text.startswith("@"):
            with open(text[1:], encoding="utf-8") as handle:
                return json.load(handle)
        return json.loads(text)
    except (OSError, json.JSONDecodeError) as err:
        raise SystemExit(f"clusterwire: invalid {what} {text!r}: {err}") from None


def _resolver_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``--jobs ps=1,worker=3`` and ``--resolver-arg KEY=VALUE`` (VALUE as JSON, else text)."""
    kwargs: dict[str, Any] = {}
    for item in args.resolver_args:
        key, sep, value = item.partition("=")
        if not sep or not key.isidentifier():
            raise SystemExit(f"clusterwire: --resolver-arg {item!r} must be KEY=VALUE")
        try:
            kwargs[key] = json.loads(value)
        except json.JSONDecodeError:
            kwargs[key] = value
    if args.jobs:
        try:
            kwargs["jobs"] = {job: int(count) for job, _, count in
                              (part.partition("=") for part in args.jobs.split(","))}
        except ValueError:
            raise SystemExit(
                f"clusterwire: --jobs {args.jobs!r} must be like ps=1,worker=3") from None
    return kwargs


def _make_resolver(args: argparse.Namespace) -> Any:
    """The ClusterResolver named by ``--resolver``, built through the plugin manager; a
    missing or unknown argument is an InvalidArgumentError naming the flag that gives it."""
    import inspect

    from clusterwire.plugins import get_plugin_manager

    factory = get_plugin_manager().resolver_spec(args.resolver).factory
    kwargs = _resolver_kwargs(args)
    try:
        inspect.signature(factory).bind(**kwargs)
    except TypeError as err:
        parameters = inspect.signature(factory).parameters
        needed = [name for name, p in parameters.items() if p.default is p.empty
                  and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and name not in kwargs]
        known = ", ".join(name for name in parameters if name not in ("self", "args", "kwargs"))
        fix = (f"give {', '.join(f'--resolver-arg {name}=VALUE' for name in needed)}" if needed
               else f"its arguments are: {known}")
        raise errors.InvalidArgumentError(
            f"Resolver {args.resolver!r}: {err}; {fix} (VALUE as JSON or text).") from None
    return factory(**kwargs)


def _add_resolver_args(parser: argparse.ArgumentParser, required: bool) -> None:
    parser.add_argument("--resolver", required=required, metavar="NAME",
                        help="cluster resolver (see `clusterwire plugins`), e.g. slurm, tfconfig")
    parser.add_argument("--jobs", help="jobs and task counts for the resolver, e.g. ps=1,worker=3")
    parser.add_argument("--resolver-arg", dest="resolver_args", action="append", default=[],
                        metavar="KEY=VALUE", help="resolver argument (VALUE as JSON, else text)")


def _resolve(args: argparse.Namespace) -> int:
    resolver = _make_resolver(args)
    print(json.dumps({"cluster": resolver.cluster_spec().as_dict(), "task_type": resolver.task_type,
                      "task_id": resolver.task_id, "master": resolver.master(),
                      "rpc_layer": resolver.rpc_layer}, indent=2))
    return 0


def _with_metrics_options(config: Any, args: argparse.Namespace) -> Any:
    """``--config`` with ``--metrics-port`` and ``--metrics-host`` merged in."""
    from clusterwire.data.cli import check_metrics_arguments

    flags = [(field, flag, value) for field, flag, value in (
        ("metrics_port", "--metrics-port", args.metrics_port),
        ("metrics_host", "--metrics-host", args.metrics_host)) if value is not None]
    if not flags:
        return config
    check_metrics_arguments(args, isinstance(config, dict) and "metrics_port" in config)
    if config is not None and not isinstance(config, dict):
        raise errors.InvalidArgumentError(
            f"{flags[0][1]} needs --config to be a JSON object of ServerOptions fields, got "
            f"{config!r}.")
    config = dict(config or {})
    for field, flag, value in flags:
        if config.setdefault(field, value) != value:
            raise errors.InvalidArgumentError(
                f"--config sets {field}={config[field]!r} and {flag} {value!r}: give one.")
    return config


def _with_membership_changes(config: Any) -> dict:
    """``--config`` with allow_membership_changes (``--allow-membership-changes``)."""
    if config is not None and not isinstance(config, dict):
        raise errors.InvalidArgumentError(
            "--allow-membership-changes needs --config to be a JSON object of ServerOptions "
            f"fields, got {config!r}.")
    return {**(config or {}), "allow_membership_changes": True}


def _serve(args: argparse.Namespace) -> int:
    from clusterwire.data.cli import import_modules
    from clusterwire.ready_line import say_ready
    from clusterwire.server import Server

    import_modules("serve", args.imports)
    config = _json_arg(args.config, "--config") if args.config else None
    config = _with_metrics_options(config, args)
    if args.allow_membership_changes:
        config = _with_membership_changes(config)
    if args.watch is not None and (args.join or not args.resolver):
        raise SystemExit("clusterwire serve: --watch follows --resolver: give it with "
                         "--resolver (and no --join)")
    withdraw = None
    if args.join:
        server = _join(args, config)
    elif args.resolver:
        if args.cluster:
            raise SystemExit("clusterwire serve: give --cluster or --resolver, not both")
        resolver = _make_resolver(args)
        try:
            server = Server.from_resolver(resolver, protocol=args.protocol, config=config,
                                          watch=args.watch)
        except errors.UnavailableError as err:
            if args.resolver != "slurm" or "Could not bind" not in err.message:
                raise
            raise errors.UnavailableError(
                f"{err.message} The Slurm resolver puts the k-th task of a node at port_base "
                "+ k: pick a free range with --resolver-arg port_base=N (the example sbatch "
                "script reads CLUSTERWIRE_PORT_BASE).") from None
        try:
            withdraw = resolver.register_task(server)
        except BaseException:
            server.stop(0)
            raise
    elif args.cluster:
        server = Server(_json_arg(args.cluster, "--cluster"), job_name=args.job_name,
                        task_index=args.task_index, protocol=args.protocol, config=config)
    else:
        raise SystemExit("clusterwire serve: give --cluster JSON or --resolver NAME")

    def stop() -> None:
        if withdraw is not None:  # first, so that no peer is sent here while it drains
            withdraw()
        server.stop(args.grace)

    def on_signal(signum: int, _frame: Any) -> None:
        threading.Thread(target=stop, daemon=True).start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    sd = server.server_def
    say_ready(server.target)
    if not args.quiet:
        metrics = f", metrics at {server.metrics_url}" if server.metrics_url else ""
        print(f"clusterwire: serving /job:{sd.job_name}/task:{sd.task_index} at "
              f"{server.target}{metrics}", file=sys.stderr, flush=True)
    server.join()
    if not args.quiet:
        print(f"clusterwire: /job:{sd.job_name}/task:{sd.task_index} at {server.target} "
              "stopped", file=sys.stderr, flush=True)
    return 0


def _join(args: argparse.Namespace, config: Any) -> Any:
    """A task joining the running cluster of ``--join``: its job and address from
    ``--resolver`` (the task it is in its own launch, e.g. a Slurm step) or from
    ``--job-name`` and ``--address``."""
    from clusterwire.joining import join

    if args.cluster:
        raise SystemExit("clusterwire serve: --join takes its cluster from the running "
                         "tasks; give no --cluster")
    if args.resolver:
        if args.job_name or args.address:
            raise SystemExit("clusterwire serve: with --resolver, the resolver names this "
                             "task's job and address; give no --job-name or --address")
        resolver = _make_resolver(args)
        job, rank = resolver.task_type, int(resolver.task_id)
        address = resolver.cluster_spec().task_address(job, rank)
    else:
        if not args.job_name:
            raise SystemExit("clusterwire serve: --join needs --job-name (or --resolver)")
        job, rank, address = args.job_name, 0, args.address or "127.0.0.1:0"
    return join(args.join, job, address, protocol=args.protocol, config=config, rank=rank)


def _status(args: argparse.Namespace) -> int:
    from clusterwire.addressing import split_target
    from clusterwire.membership import MAX_TASKS
    from clusterwire.security import load_security
    from clusterwire.server_kind import TASK, first_failure, wrong_kind
    from clusterwire.session import Session
    from clusterwire.status_text import summary, task_line

    if args.all and args.task:
        raise SystemExit("clusterwire status: give --task or --all, not both")
    options = security_options(args)
    try:
        with Session(args.target, config=options, timeout=args.timeout) as session:
            statuses = (session.cluster_status() if args.all
                        else {"": session.status(task=args.task)})
    except errors.OpError as err:
        protocol, address = split_target(args.target)
        better = first_failure(
            "status", err.error_code, f"The task at {args.target}",
            f"{type(err).__name__}: {err.message}",
            lambda: None if args.task else wrong_kind(
                protocol, address, load_security(options), args.timeout, TASK))
        if better is None:
            raise
        raise better from None
    if args.json:
        for status in statuses.values():
            if "cluster" in status:
                status["cluster"] = status["cluster"].as_dict()
        print(json.dumps(statuses if args.all else statuses[""], indent=2))
    elif args.all:
        print("\n".join(task_line(task, status) for task, status in statuses.items()))
    else:
        print("\n".join(summary(statuses[""])))
    left_out = getattr(statuses, "left_out", 0)
    if left_out:
        print(f"clusterwire status: the target listed {len(statuses) + left_out} tasks, more "
              f"than a cluster has ({MAX_TASKS}): the first {len(statuses)} are shown, "
              f"{left_out} left out", file=sys.stderr)
    return 1 if left_out or any("error" in status for status in statuses.values()) else 0


def _top(args: argparse.Namespace) -> int:
    if (args.target is None) == (args.dispatcher is None):
        raise SystemExit("clusterwire top: give a TARGET (a task's grpc://host:port) or "
                         "--dispatcher HOST:PORT (the data service's), one of them")
    if args.protocol is not None and args.dispatcher is None:
        raise SystemExit("clusterwire top: --protocol is for --dispatcher; a TARGET names "
                         "its own (grpc://host:port)")
    for flag, value in (("--interval", args.interval), ("--timeout", args.timeout)):
        if value is not None and not value > 0:
            raise errors.InvalidArgumentError(
                f"{flag} {value!r}: must be a number of seconds > 0, e.g. {flag} 1.")
    try:
        import rich  # noqa: F401 - an extra: say how to get it before anything starts
    except ImportError:
        print("clusterwire top needs rich, which is not installed: "
              "pip install 'clusterwire[top]'", file=sys.stderr)
        return 2
    from clusterwire import top

    # The table shows which tasks are unreachable; the client's retry warnings on stderr
    # would only scroll it.
    logging.getLogger("clusterwire").addHandler(logging.NullHandler())
    from clusterwire.security import load_security

    timeout = args.interval if args.timeout is None else args.timeout
    security = load_security(security_options(args))
    view = (top.task_view(args.target, args.interval, timeout, security)
            if args.target is not None
            else top.data_view(args.dispatcher, args.protocol or "grpc", args.interval,
                               timeout, security))
    return top.run(view, args.interval, args.once)


def _runs_here(manager: Any, kind: str, name: str) -> str:
    """Whether a transport can run in this environment, and the fix when it cannot."""
    if kind != "transport":
        return ""
    try:
        manager.transport(name)
    except errors.OpError as err:
        return f"no: {err.message}"
    return "yes"


def _plugins(args: argparse.Namespace) -> int:
    from clusterwire.plugins import get_plugin_manager

    manager = get_plugin_manager()
    listing = sorted(manager.listing(), key=lambda i: (i.kind != "transport", i.kind, i.name))
    # A distribution's metadata and a failing plugin's error are anyone's text.
    rows = [tuple(printable(v) for v in (i.kind, i.name, i.module, i.distribution, i.version,
                                         _runs_here(manager, i.kind, i.name)))
            for i in listing]
    header = ("KIND", "NAME", "MODULE", "DISTRIBUTION", "VERSION", "RUNS HERE")
    widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip())
    for info in get_plugin_manager().listing():
        if info.kind == "broken":
            print(f"plugin '{printable(info.plugin)}' failed to load: "
                  f"{printable(info.description)}", file=sys.stderr)
    return 0


def _demo(args: argparse.Namespace) -> int:
    if args.elastic:
        from clusterwire.demo_elastic import run_elastic_demo

        if args.workers is not None or args.chaos:
            raise SystemExit("clusterwire demo: --elastic sets its own workers (2 -> 4 -> 3, "
                             "one SIGKILLed); give no --workers or --chaos")
        return run_elastic_demo(protocol=args.protocol, steps=args.steps)
    from clusterwire.demo import run_demo

    return run_demo(protocol=args.protocol, steps=args.steps, workers=args.workers or 2,
                    chaos=args.chaos)


class _DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """Adds "(default: X)" to an option's help where X is a value: not after a flag, nor
    after an option whose help says its default itself (its default None: not given)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``clusterwire`` command."""
    from clusterwire.data.cli import add_commands

    parser = argparse.ArgumentParser(
        prog="clusterwire",
        description="Run and inspect clusterwire clusters: serve a task, resolve a cluster, "
                    "ask tasks for their status, list plugins, run the demo, serve the data "
                    "service's dispatcher and workers. `clusterwire COMMAND --help` for one.")
    parser.add_argument("--version", action="version",
                        version=f"clusterwire {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    _add_serve(commands)
    _add_resolve(commands)
    _add_status(commands)
    _add_top(commands)
    _add_plugins(commands)
    _add_demo(commands)
    add_commands(commands)
    return parser


def _add_serve(commands: Any) -> None:
    """``serve``: one task of a cluster, until SIGINT/SIGTERM."""
    from clusterwire.data.cli import add_metrics_arguments

    serve = commands.add_parser("serve", help="run one task of a cluster until SIGINT/SIGTERM")
    serve.add_argument("--cluster",
                       help='cluster spec as JSON or @file, e.g. \'{"worker": ["127.0.0.1:0"]}\'')
    _add_resolver_args(serve, required=False)
    serve.add_argument("--job-name")
    serve.add_argument("--task-index", type=int)
    serve.add_argument("--protocol", default=None, help="transport protocol (default: grpc)")
    serve.add_argument("--config", help="ServerOptions as JSON or @file; fields: " + ", ".join(
        ServerOptions.DESCRIPTOR.fields_by_name))
    serve.add_argument("--import", dest="imports", action="append", default=[],
                       metavar="MODULE", help="import MODULE first (registers @remote functions)")
    serve.add_argument("--grace", type=float, default=5.0,
                       help="seconds in-flight requests get at shutdown (default 5)")
    serve.add_argument("--quiet", action="store_true", help="no banner on stderr")
    add_metrics_arguments(serve)
    serve.add_argument("--join", metavar="TARGET",
                       help="join the running cluster of TARGET (a task's protocol://host:port) "
                            "as the next task(s) of --job-name, or of the resolver's job: the "
                            "grown cluster becomes its next membership version")
    serve.add_argument("--allow-membership-changes", action="store_true",
                       help="take membership changes from clients and peers that join or "
                            "remove tasks (update_cluster, --join): an elastic cluster "
                            "(default: refused)")
    serve.add_argument("--watch", type=float, metavar="SECONDS",
                       help="with --resolver: follow it, reading the cluster every SECONDS "
                            "(and at once when the resolver reports a change, as etcd's "
                            "does); each change becomes a membership version (default: the "
                            "cluster is read once)")
    serve.add_argument("--address", metavar="HOST:PORT",
                       help="with --join and --job-name: this task's address (default "
                            "127.0.0.1:0)")
    serve.set_defaults(run=_serve)


def _add_resolve(commands: Any) -> None:
    """``resolve``: a resolver's cluster, this task and the master, as JSON."""
    resolve = commands.add_parser(
        "resolve", help="print a resolver's cluster, this task and the master as JSON")
    _add_resolver_args(resolve, required=True)
    resolve.set_defaults(run=_resolve)


def _add_status(commands: Any) -> None:
    """``status``: a task's status (or every task's)."""
    status = commands.add_parser(
        "status", help="summarise a task's status (--json: the whole status document)",
        description="Print a task's status: a short summary (task, address, state and uptime, "
                    "protocol, membership version and size, requests served and failed, "
                    "store), or with --all one line per task (a task that did not answer: "
                    "its address and why). --json prints the whole status document, for "
                    "scripts.")
    status.add_argument("target", help="e.g. grpc://127.0.0.1:2222")
    status.add_argument("--task", help="another task of the cluster, e.g. /job:ps/task:0")
    status.add_argument("--all", action="store_true",
                        help="every task of the target's cluster (as many as a cluster "
                             "may have, membership's MAX_TASKS), asked concurrently within "
                             "one --timeout; exits 1 if any did not answer or the target "
                             "listed more")
    status.add_argument("--json", action="store_true",
                        help="print the whole status as JSON (with --all: task -> status, "
                             "or {\"error\", \"address\"} for a task that did not answer)")
    status.add_argument("--timeout", type=float, default=10.0,
                        help="seconds for the answer; with --all, for the whole cluster's "
                             "(default 10)")
    add_security_arguments(status, server=False)
    status.set_defaults(run=_status)


def _add_top(commands: Any) -> None:
    """``top``: a live view of a cluster's tasks or of a data service."""
    top = commands.add_parser(
        "top", help="a live table of a cluster's tasks (or the data service's workers and "
                    "jobs) until Ctrl-C",
        description="A live table of every task of TARGET's cluster: health, requests/s, "
                    "errors/s (non-OK), bytes in/s and out/s, requests in flight, store bytes "
                    "and the peers each task cannot reach. Every refresh asks each task once, "
                    "all at once (at most 64: the target's and the first 63 others of the "
                    "cluster it reported first); a task that does not answer within --timeout "
                    "is shown unreachable. Rates are the counters' differences between two "
                    "refreshes over the time measured between them (none on the first frame); "
                    "top's own "
                    "status requests are not counted. With --dispatcher: the data service's "
                    "workers (heartbeat age, elements/s, bytes/s, buffered elements, open "
                    "streams, requests/s, errors/s) and jobs (consumers, splits, elements/s). "
                    "Needs rich: pip install 'clusterwire[top]'.")
    top.add_argument("target", nargs="?", help="a task of the cluster, e.g. grpc://127.0.0.1:2222")
    top.add_argument("--dispatcher", metavar="HOST:PORT[,HOST:PORT]",
                     help="show the data service instead: its dispatcher, every worker it "
                          "lists, and the jobs (a primary and its standbys, comma-separated: "
                          "the one that serves)")
    top.add_argument("--protocol",
                     help="the data service's protocol (with --dispatcher; default grpc)")
    top.add_argument("--interval", type=float, default=1.0,
                     help="seconds between refreshes (default 1)")
    top.add_argument("--timeout", type=float,
                     help="seconds each server gets to answer (default: the interval)")
    top.add_argument("--once", action="store_true",
                     help="print one table (two snapshots --interval apart, for the rates) and "
                          "exit: 0 if every server answered, else 1")
    add_security_arguments(top, server=False)
    top.set_defaults(run=_top)


def _add_plugins(commands: Any) -> None:
    """``plugins``: the installed transports and resolvers."""
    plugins = commands.add_parser("plugins", help="list installed transports and resolvers")
    plugins.set_defaults(run=_plugins)


def _add_demo(commands: Any) -> None:
    """``demo``: parameter-server training on a local cluster."""
    demo = commands.add_parser(
        "demo", help="train a model parameter-server style on a local 3-process cluster",
        description="Train a linear model parameter-server style on a local cluster (1 ps and "
                    "--workers workers, each its own process); print progress, what moved, and "
                    "a verdict; exit 1 unless the loss fell 100x and every process stopped "
                    "cleanly.", formatter_class=_DefaultsHelp)
    demo.add_argument("--protocol", default="grpc",
                      help="transport protocol (see `clusterwire plugins`)")
    demo.add_argument("--steps", type=int, default=60,
                      help="training steps of each worker (the ps counts steps x workers)")
    demo.add_argument("--workers", type=int, help="worker tasks beside the ps (default: 2)")
    demo.add_argument("--chaos", action="store_true",
                      help="SIGKILL a worker a third of the way through, restart it on the same "
                           "port, and check the ps kept its state")
    demo.add_argument("--elastic", action="store_true",
                      help="change the cluster while it trains: the workers go 2 -> 4 -> 3 "
                           "(one SIGKILLed), each membership change printed as it happens")
    demo.set_defaults(run=_demo)


def main(argv: list[str] | None = None) -> int:
    """Run the command line; clusterwire errors print as one line and exit 1."""
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (errors.OpError, ValueError, TypeError) as err:
        # The message may quote a peer (its error, its address): one escaped line.
        print(f"clusterwire {args.command}: {type(err).__name__}: "
              f"{printable(str(err), LOG_CHARS)}", file=sys.stderr)
        return 1
