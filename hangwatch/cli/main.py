"""``hangwatch`` subcommands: coordinator, agent, status, incidents, report, stacks, analyze, run, demo.

Configuration: flags, then ``HANGWATCH_*`` environment variables, then defaults.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import sys
import threading
import time
from typing import Any

from hangwatch import config, gctune, tls
from hangwatch.cli import render
from hangwatch.cli.client import CoordinatorUnreachable, query
from hangwatch.cli.parser import TokenError, parse_args, resolve_tokens
from hangwatch.untrusted import printable


def _addr(args: argparse.Namespace) -> str:
    return str(args.addr or config.default_addr())


def _token(args: argparse.Namespace) -> str | None:
    return args.token or os.environ.get(config.ENV_TOKEN) or None


def _print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=True) + "\n")


def cmd_status(args: argparse.Namespace) -> int:
    while True:
        data = query(_addr(args), "GetStatus", token=_token(args), job=args.job)
        if args.json:
            _print_json(data)
            return 0
        if args.watch:
            sys.stdout.write("\033[H\033[J" if sys.stdout.isatty() else "\n")
        render.render_status(data)
        if not args.watch:
            return 0
        sys.stdout.flush()
        time.sleep(1.0)


def cmd_incidents(args: argparse.Namespace) -> int:
    data = query(_addr(args), "ListIncidents", token=_token(args), limit=args.limit, job=args.job)
    if args.json:
        _print_json(data)
    else:
        render.render_incidents(data)
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    ident = args.id
    if ident is None:
        incidents = query(_addr(args), "ListIncidents", token=_token(args), limit=1, job=args.job)
        if not incidents:
            sys.stderr.write("hangwatch: no incidents yet\n")
            return 1
        ident = incidents[-1]["id"]
    data = query(_addr(args), "GetIncident", token=_token(args), id=ident)
    if args.graph:
        return _report_graph(data, args.format)
    if args.json:
        _print_json(data)
    else:
        render.render_report(data)
    return 0


def _report_graph(data: dict[str, Any], fmt: str) -> int:
    from hangwatch.cli import graphs

    graph = (data.get("details") or {}).get("graph")
    if not graph:
        sys.stderr.write(f"hangwatch: {data['id']} has no wait-for graph: nobody waited on what it tells\n")
        return 1
    if fmt == "dot":
        sys.stdout.write(graphs.dot(graph, data["id"]))
    else:
        sys.stdout.write(f"{data['id']}: who waited for whom when it was told\n")
        sys.stdout.write("".join(f"  {line}\n" for line in graphs.text(graph)))
    return 0


def cmd_analyze(args: argparse.Namespace) -> int:
    from hangwatch.postmortem import dumps, packed, replay

    try:
        folder = dumps.load(args.dir, args.prefix)
    except dumps.DumpError as exc:
        sys.stderr.write(f"hangwatch: {exc}\n")
        return 2
    for path, why in sorted(folder.refused.items()):
        sys.stderr.write(printable(f"hangwatch: {path}: skipped: {why}") + "\n")
    if not folder.dumps:
        prefix = f" starting with {args.prefix!r}" if args.prefix else ""
        sys.stderr.write(
            f"hangwatch: no Flight Recorder dump in {args.dir} (files{prefix} ending with a rank number)\n"
        )
        return 2
    if args.import_:
        from hangwatch.cli.client import import_dumps

        payload, size = packed.pack(folder)
        if len(payload) > packed.MAX_SEND_BYTES or size > packed.MAX_IMPORT_BYTES:
            sys.stderr.write(
                f"hangwatch: {size >> 20} MiB of dumps to send ({len(payload) >> 20} MiB compressed), more than the "
                f"coordinator takes in one import ({packed.MAX_IMPORT_BYTES >> 20} MiB, "
                f"{packed.MAX_SEND_BYTES >> 20} MiB compressed): import the ranks in parts (--prefix)\n"
            )
            return 2
        result = import_dumps(_addr(args), payload, token=_token(args), job=args.job)
        if args.json:
            _print_json(result)
        else:
            render.render_import(result)
        return 0
    if args.world_size is not None and not 0 < args.world_size <= dumps.MAX_RANKS:
        sys.stderr.write(f"hangwatch: --world-size must be between 1 and {dumps.MAX_RANKS}\n")
        return 2
    if args.stuck_after is not None and not 0 < args.stuck_after < float("inf"):
        sys.stderr.write("hangwatch: --stuck-after must be a positive number of seconds\n")
        return 2
    stuck_after = args.stuck_after if args.stuck_after is not None else replay.DEFAULT_STUCK_AFTER_S
    analysis = replay.analyze(folder, stuck_after=stuck_after, world_size=args.world_size)
    if args.json:
        _print_json(analysis.incidents_json())
        for note in analysis.notes:
            sys.stderr.write(printable(f"hangwatch: {note}") + "\n")
        return 0
    text = io.StringIO()
    render.render_analysis(analysis, folder, text)
    sys.stdout.write(printable(text.getvalue()))  # names and paths from files: no escape reaches the terminal
    return 0


def cmd_stacks(args: argparse.Namespace) -> int:
    data = query(
        _addr(args), "DumpStacks", token=_token(args), id=str(args.rank), native=args.native, job=args.job, timeout=30.0
    )
    if args.json:
        _print_json(data)
        return 0
    grouped = render.group_stacks({rk: d["text"] for rk, d in data.items() if not d.get("error")})
    for ranks, text in grouped:
        sys.stdout.write(f"--- rank{'s' if len(ranks) > 1 else ''} {render.format_ranks(ranks)} ---\n{text.rstrip()}\n")
    for rk, d in sorted(data.items()):
        if d.get("error"):
            sys.stdout.write(f"--- rank {rk}: no stack: {d['error']}\n")
    return 0


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s hangwatch %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
    )


def _coordinator_options(args: argparse.Namespace, host: str, port: int) -> Any:
    from hangwatch.coordinator.daemon import CoordinatorOptions

    return CoordinatorOptions(
        host=host,
        port=port,
        data_dir=args.data_dir,
        token=args.token,
        agent_token=getattr(args, "agent_token", None),
        stuck_after=args.stuck_after,
        steady_read_s=getattr(args, "steady_read", None),
        embedded_agent=not args.no_agent,
        abort_on_hang=args.abort_on_hang,
        allow_insecure_bind=args.allow_insecure_bind,
        metrics_port=args.metrics_port,
        max_data_mb=args.max_data_mb,
        rank_budget_mb=args.rank_budget_mb,
        job_budget_mb=args.job_budget_mb,
        memory_budget_mb=args.memory_budget_mb,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_client_ca=args.tls_client_ca,
        alert_webhook=args.alert_webhook,
    )


def cmd_coordinator(args: argparse.Namespace) -> int:
    from hangwatch.coordinator.daemon import ConfigError, Coordinator
    from hangwatch.coordinator.store import StoreError
    from hangwatch.tls import TLSConfigError

    _setup_logging(args.verbose)
    try:
        coordinator = Coordinator(_coordinator_options(args, args.host, args.port))
        coordinator.start()
        gctune.tune()
    except (ConfigError, StoreError, TLSConfigError) as exc:
        sys.stderr.write(f"hangwatch: {exc}\n")
        return 2
    host = "127.0.0.1" if args.host in ("127.0.0.1", "localhost") else coordinator.addr.rsplit(":", 1)[0]
    metrics = f", metrics on :{coordinator.metrics.port}/metrics" if coordinator.metrics else ""
    sys.stdout.write(
        f"hangwatch coordinator listening on {args.host}:{coordinator.port} (data: {args.data_dir}{metrics})\n"
        f"attach ranks with:\n  export {config.ENV_ADDR}={host}:{coordinator.port}\n"
    )
    sys.stdout.flush()
    try:
        coordinator.wait()
    except KeyboardInterrupt:
        pass
    finally:
        coordinator.stop()
    return 0


def cmd_agent(args: argparse.Namespace) -> int:
    from hangwatch.agent.core import NodeAgentCore
    from hangwatch.agent.daemon import run_agent

    _setup_logging(args.verbose)
    addr = args.coordinator or config.default_addr()
    stop = threading.Event()
    core = NodeAgentCore(host=args.node_name)
    relay = None
    if args.relay_port:
        relay = _start_relay(args, addr, core.host)
        if relay is None:
            return 2
    # ranks find the agent's socket from the port their HANGWATCH_ADDR names: the relay's if any
    rank_socket = args.rank_socket or config.agent_socket_path(relay.addr if relay is not None else addr)
    sys.stdout.write(f"hangwatch agent serving coordinator {addr}; rank links on {rank_socket}\n")
    if relay is not None:
        sys.stdout.write(f"relaying this node's ranks: export {config.ENV_ADDR}={relay.addr}\n")
    sys.stdout.flush()
    gctune.tune()
    try:
        run_agent(
            addr,
            token=args.agent_token or args.token,
            stop=stop,
            core=core,
            rank_socket=rank_socket,
            rank_socket_mode=args.rank_socket_mode,
        )
    except KeyboardInterrupt:
        stop.set()
    finally:
        if relay is not None:
            relay.stop()
    return 0


def _start_relay(args: argparse.Namespace, addr: str, host: str) -> Any:
    from hangwatch.agent.relay import Relay, RelayServer
    from hangwatch.serving import is_loopback

    if not is_loopback(args.relay_host) and not args.token and not args.allow_insecure_bind:
        sys.stderr.write(
            f"hangwatch agent: refusing to relay on non-loopback {args.relay_host} without a token "
            f"(--token / ${config.ENV_TOKEN}), or --allow-insecure-bind on a trusted network\n"
        )
        return None
    credentials = None
    if args.tls_cert or args.tls_key:
        if not (args.tls_cert and args.tls_key):
            sys.stderr.write("hangwatch agent: TLS needs both --tls-cert and --tls-key\n")
            return None
        credentials = tls.server_credentials(args.tls_cert, args.tls_key)
    relay = Relay(addr, args.agent_token or args.token, host, interval_s=max(0.0, args.relay_interval))
    try:
        server = RelayServer(relay, args.token, args.relay_host, args.relay_port, credentials)
    except (OSError, RuntimeError) as exc:
        sys.stderr.write(f"hangwatch agent: {exc}\n")
        return None
    server.start()
    return server


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        resolve_tokens(args)
    except TokenError as exc:
        sys.stderr.write(f"hangwatch: {exc}\n")
        return 2
    handlers = {
        "coordinator": cmd_coordinator,
        "agent": cmd_agent,
        "status": cmd_status,
        "incidents": cmd_incidents,
        "report": cmd_report,
        "stacks": cmd_stacks,
        "analyze": cmd_analyze,
    }
    try:
        if args.command in ("run", "demo"):
            from hangwatch.cli import launch

            return launch.cmd_run(args) if args.command == "run" else launch.cmd_demo(args)
        return handlers[args.command](args)
    except CoordinatorUnreachable as exc:
        sys.stderr.write(f"hangwatch: {exc}\n")
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
