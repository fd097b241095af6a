"""The command line: every verb's flags, the environment variables behind them, and tokens."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from hangwatch import __version__, config
from hangwatch.diagnosis import budget


def _env_default_float(name: str) -> float | None:
    value = os.environ.get(name)
    try:
        return float(value) if value else None
    except ValueError:
        return None


def _add_query_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--addr",
        default=None,
        help=f"coordinator host:port (default: ${config.ENV_ADDR}, then {config.DEFAULT_ADDR})",
    )
    p.add_argument("--token", default=None, help=f"shared token (default: ${config.ENV_TOKEN}; prefer --token-file)")
    p.add_argument("--token-file", default=None, help=f"read the token from this file (or ${config.ENV_TOKEN_FILE})")
    p.add_argument("--json", action="store_true", help="print JSON (the documented contract)")


def _add_job_flag(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument(
        "--job",
        default="",
        help=f"the job: its key, job id or run (as status lists them), or a prefix of one (default: {default})",
    )


def _add_coordinator_flags(p: argparse.ArgumentParser, *, with_port: bool = True) -> None:
    if with_port:
        p.add_argument(
            "--host",
            default=config.DEFAULT_HOST,
            help=f"interface to listen on (default {config.DEFAULT_HOST}; a non-loopback one needs --token)",
        )
        p.add_argument(
            "--port", type=int, default=config.DEFAULT_PORT, help=f"gRPC port (default {config.DEFAULT_PORT})"
        )
    p.add_argument(
        "--data-dir",
        default=os.environ.get(config.ENV_DATA_DIR, config.DEFAULT_DATA_DIR),
        help=f"where incidents are stored (default ${config.ENV_DATA_DIR}, then {config.DEFAULT_DATA_DIR})",
    )
    p.add_argument(
        "--max-data-mb",
        type=float,
        default=config.env_float(config.ENV_MAX_DATA_MB, config.DEFAULT_MAX_DATA_MB),
        help=f"cap of the incident store in MiB; the oldest incidents are pruned first "
        f"(default ${config.ENV_MAX_DATA_MB}, then {config.DEFAULT_MAX_DATA_MB:.0f})",
    )
    for flag, default, what, told in (
        ("--rank-budget-mb", budget.DEFAULT_RANK_MB, "one rank's calls, history and tables", ""),
        (
            "--job-budget-mb",
            None,
            "one job's",
            f"{budget.DEFAULT_JOB_MB}, or {budget.JOB_KIB_PER_RANK} KiB a rank where that is more",
        ),
        ("--memory-budget-mb", budget.DEFAULT_TOTAL_MB, "every job's together", ""),
    ):
        p.add_argument(
            flag,
            type=float,
            default=None if default is None else float(default),
            help=f"memory budget in MiB for {what} (default {told or default}); calls beyond it are refused "
            "and counted in status and /metrics",
        )
    p.add_argument(
        "--token",
        default=None,
        help=f"shared token ranks, agents and the CLI must present (default ${config.ENV_TOKEN}; on the "
        "command line every user sees it in ps: prefer --token-file or the variable)",
    )
    p.add_argument("--token-file", default=None, help=f"read the token from this file (or ${config.ENV_TOKEN_FILE})")
    p.add_argument(
        "--agent-token",
        default=None,
        help=f"node agents' own credential, which ranks never hold (default ${config.ENV_AGENT_TOKEN}; "
        "without it agents present --token)",
    )
    p.add_argument(
        "--agent-token-file", default=None, help=f"read it from this file (or ${config.ENV_AGENT_TOKEN_FILE})"
    )
    p.add_argument(
        "--stuck-after",
        type=float,
        default=_env_default_float(config.ENV_STUCK_AFTER),
        metavar="SECONDS",
        help=f"fixed hang threshold (default ${config.ENV_STUCK_AFTER}, else adaptive: "
        f"between {config.MIN_STUCK_AFTER:.0f} and {config.DEFAULT_STUCK_AFTER:.0f} s from observed "
        "wait and step times)",
    )
    p.add_argument(
        "--steady-read",
        type=float,
        default=None,
        metavar="SECONDS",
        help="how far apart node agents read the ring of a rank in a steady state, saying it alive "
        "between (default: as the job's size asks, its report interval up to 8,192 ranks, 4 s at "
        "16,384, 5 s at most)",
    )
    p.add_argument(
        "--abort-on-hang",
        action="store_true",
        default=config.env_flag(config.ENV_ABORT_ON_HANG),
        help=f"terminate the job's ranks once a hang is diagnosed and its stacks stored "
        f"(default ${config.ENV_ABORT_ON_HANG} or off)",
    )
    p.add_argument(
        "--alert-webhook",
        default=os.environ.get(config.ENV_ALERT_WEBHOOK),
        help=f"POST every new incident as JSON to this URL (default ${config.ENV_ALERT_WEBHOOK})",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=config.env_int(config.ENV_METRICS_PORT, config.DEFAULT_METRICS_PORT),
        help=f"Prometheus /metrics port, 0 = off (default ${config.ENV_METRICS_PORT}, "
        f"then {config.DEFAULT_METRICS_PORT})",
    )
    p.add_argument("--no-agent", action="store_true", help="do not embed a node agent (stacks come from remote agents)")
    p.add_argument(
        "--allow-insecure-bind",
        action="store_true",
        help="allow a non-loopback --host without a token (trusted networks only)",
    )
    p.add_argument(
        "--tls-cert",
        default=os.environ.get(config.ENV_TLS_CERT),
        help=f"serve TLS with this certificate (PEM; default ${config.ENV_TLS_CERT})",
    )
    p.add_argument(
        "--tls-key",
        default=os.environ.get(config.ENV_TLS_KEY),
        help=f"the certificate's private key (PEM; default ${config.ENV_TLS_KEY})",
    )
    p.add_argument(
        "--tls-client-ca",
        default=os.environ.get(config.ENV_TLS_CLIENT_CA),
        help=f"require client certificates signed by this CA (default ${config.ENV_TLS_CLIENT_CA})",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="log more")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hangwatch",
        description="Out-of-process hang diagnosis for PyTorch distributed training.",
        epilog=f"Attach ranks with no code change: export {config.ENV_ADDR}=host:port. "
        f"{config.ENV_DISABLE}=1 turns the hook off.",
    )
    parser.add_argument("--version", action="version", version=f"hangwatch {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("coordinator", help="run the coordinator daemon (with an embedded node agent)")
    _add_coordinator_flags(p)

    p = sub.add_parser("agent", help="run a node agent that watches this node's ranks and dumps their stacks")
    p.add_argument(
        "--rank-socket",
        default=None,
        help=f"Unix socket this node's ranks link to (default ${config.ENV_AGENT_SOCKET}, then agent-<port>.sock "
        "in this user's private directory, <port> being the relay's or the coordinator's)",
    )
    p.add_argument(
        "--rank-socket-mode",
        type=_socket_mode,
        default=0o600,
        help="permissions of the rank socket, octal (default 0600: ranks of this user only; 0666 lets every "
        "user's ranks link to an agent run as root, each link's pid and uid still proven by the kernel)",
    )
    p.add_argument(
        "--coordinator",
        "--addr",
        dest="coordinator",
        default=None,
        help=f"coordinator host:port (default ${config.ENV_ADDR}, then {config.DEFAULT_ADDR})",
    )
    p.add_argument(
        "--token",
        default=None,
        help=f"shared token (default ${config.ENV_TOKEN}; prefer --token-file)",
    )
    p.add_argument("--token-file", default=None, help=f"read the token from this file (or ${config.ENV_TOKEN_FILE})")
    p.add_argument(
        "--agent-token",
        default=None,
        help=f"this agent's credential, if the coordinator sets one (default ${config.ENV_AGENT_TOKEN})",
    )
    p.add_argument(
        "--agent-token-file", default=None, help=f"read it from this file (or ${config.ENV_AGENT_TOKEN_FILE})"
    )
    p.add_argument(
        "--node-name",
        default=os.environ.get(config.ENV_NODE_NAME),
        help=f"node name the ranks on this node report (default ${config.ENV_NODE_NAME}, then the hostname)",
    )
    p.add_argument(
        "--relay-port",
        type=int,
        default=config.env_int(config.ENV_RELAY_PORT, 0),
        help=f"also relay this node's ranks: listen on this port and point their {config.ENV_ADDR} at it, "
        f"so the coordinator sees one connection per node (default ${config.ENV_RELAY_PORT}; 0: no relay)",
    )
    p.add_argument(
        "--relay-host",
        default="127.0.0.1",
        help="interface the relay listens on (default 127.0.0.1; a non-loopback one needs --token)",
    )
    p.add_argument(
        "--relay-interval",
        type=float,
        default=0.5,
        metavar="SECONDS",
        help="the least time between two calls the relay makes to the coordinator; its ranks' batches "
        "gather meanwhile (default 0.5; a flush a rank waits on goes at once)",
    )
    p.add_argument(
        "--tls-cert", default=os.environ.get(config.ENV_TLS_CERT), help="relay: serve TLS with this certificate"
    )
    p.add_argument("--tls-key", default=os.environ.get(config.ENV_TLS_KEY), help="relay: ... and this key")
    p.add_argument(
        "--allow-insecure-bind",
        action="store_true",
        help="allow a non-loopback --relay-host without a token (trusted networks only)",
    )
    p.add_argument("-v", "--verbose", action="store_true")

    p = sub.add_parser("status", help="every rank's state and last collective, and open incidents")
    _add_query_flags(p)
    p.add_argument("--watch", action="store_true", help="refresh in place every second")
    _add_job_flag(p, "the latest job with a live rank")

    p = sub.add_parser("incidents", help="list incidents")
    _add_query_flags(p)
    p.add_argument("--limit", type=int, default=0, help="only the most recent N")
    _add_job_flag(p, "every job")

    p = sub.add_parser("report", help="the full diagnosis of one incident (default: the latest)")
    _add_query_flags(p)
    p.add_argument("id", nargs="?", default=None, help="incident id, e.g. inc-0001")
    p.add_argument("--graph", action="store_true", help="who waited for whom when it was told, by node")
    p.add_argument(
        "--format", choices=("text", "dot"), default="text", help="with --graph: text, or Graphviz (dot -Tsvg)"
    )
    _add_job_flag(p, "every job: the latest incident")

    p = sub.add_parser("stacks", help="dump py-spy stacks of ranks now")
    _add_query_flags(p)
    p.add_argument("rank", nargs="?", default="all", help="a rank, comma-separated ranks, or 'all'")
    p.add_argument("--native", action="store_true", help="include native (C/C++) frames")
    _add_job_flag(p, "the latest job with a live rank")

    p = sub.add_parser(
        "run",
        help="run torchrun with a coordinator and agent attached",
        description="Options hangwatch does not know, the script and its arguments go to torchrun as "
        "torchrun takes them, e.g. hangwatch run --stuck-after 20 --nproc-per-node 4 train.py --lr 0.1 "
        "(a -- before torchrun's part works too)",
    )
    _add_coordinator_flags(p, with_port=False)
    p.add_argument("--port", type=int, default=0, help="coordinator port (default: a free one)")
    p.add_argument("torchrun_args", nargs=argparse.REMAINDER, help="torchrun options, script and its arguments")

    p = sub.add_parser(
        "analyze",
        help="diagnose a hang from torch's Flight Recorder dumps (no hangwatch attached needed)",
        description="Reads one Flight Recorder dump per rank from DIR (pickle or JSON, either ring; "
        "the rank is the number a file's name ends with, as torch names them) and runs the "
        "coordinator's detectors on them: the incidents are those hangwatch would have raised live.",
    )
    p.add_argument(
        "dir", help="the folder of dumps (torch's default: /tmp, files nccl_trace_rank_<N>: give --prefix there)"
    )
    p.add_argument("--prefix", default="", help="only files whose names start with this (e.g. nccl_trace_rank_)")
    p.add_argument("--json", action="store_true", help="print the incidents as JSON (the documented contract)")
    p.add_argument(
        "--stuck-after",
        type=float,
        default=None,
        metavar="SECONDS",
        help="a call open this long when the dumps were written is a hang (default 30, the coordinator's)",
    )
    p.add_argument("--world-size", type=int, default=None, help="ranks in the job (default: from the dumps)")
    p.add_argument(
        "--import",
        dest="import_",
        action="store_true",
        help="send the dumps to a coordinator instead: it analyses them and joins them to a job's incidents",
    )
    p.add_argument("--addr", default=None, help=f"with --import: coordinator host:port (default: ${config.ENV_ADDR})")
    p.add_argument("--token", default=None, help=f"with --import: shared token (default: ${config.ENV_TOKEN})")
    p.add_argument("--token-file", default=None, help="with --import: read the token from this file")
    _add_job_flag(p, "with --import: the current job")

    p = sub.add_parser("demo", help="a built-in multi-rank CPU job with an injected fault, diagnosed live")
    p.add_argument("scenario", nargs="?", default="early_stop", help="which fault (see --list)")
    p.add_argument("--list", action="store_true", help="list the scenarios")
    p.add_argument("--nproc", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--stuck-after", type=float, default=10.0, metavar="SECONDS", help="hang threshold (default 10)")
    p.add_argument("--data-dir", default=None, help="where incidents are stored (default: a temporary directory)")
    return parser


def _socket_mode(text: str) -> int:
    try:
        mode = int(text, 8)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an octal mode such as 0600") from None
    if mode & ~0o666:
        raise argparse.ArgumentTypeError(f"{text}: a socket mode has read/write bits only (at most 0666)")
    return mode


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command line as the verbs take it; ``run`` hands torchrun what is torchrun's."""
    parser = build_parser()
    if argv[:1] == ["run"]:
        # torchrun's options as torchrun takes them, with or without "--": what hangwatch does
        # not know goes to torchrun, in the order given (argparse's remainder starts at the
        # first value it cannot place, e.g. the 4 of --nproc-per-node 4)
        args, unknown = parser.parse_known_args(argv)
        rest = list(args.torchrun_args)
        if rest[:1] == ["--"]:
            rest = rest[1:]
        args.torchrun_args = unknown + rest
        return args
    return parser.parse_args(argv)


class TokenError(ValueError):
    """A token file that cannot be read."""


def resolve_tokens(args: argparse.Namespace) -> None:
    """``args.token`` and ``args.agent_token`` from the command line, a file or the environment.
    A secret given on the command line is visible to every user in ``ps``: said once, on stderr."""
    for name, env, env_file in (
        ("token", config.ENV_TOKEN, config.ENV_TOKEN_FILE),
        ("agent_token", config.ENV_AGENT_TOKEN, config.ENV_AGENT_TOKEN_FILE),
    ):
        if not hasattr(args, name):
            continue
        if getattr(args, name):
            flag = "--" + name.replace("_", "-")
            sys.stderr.write(
                f"hangwatch: warning: {flag} on the command line is visible to every user of this machine "
                f"(ps); use {flag}-file or ${env}\n"
            )
            continue
        path = getattr(args, f"{name}_file", None) or os.environ.get(env_file)
        if path:
            try:
                value = Path(path).read_text().strip()
            except OSError as e:
                raise TokenError(f"cannot read the {flag_name(name)} file {path}: {e.strerror or e}") from None
            if not value:
                raise TokenError(f"the {flag_name(name)} file {path} is empty")
            setattr(args, name, value)
        else:
            setattr(args, name, os.environ.get(env) or None)


def flag_name(name: str) -> str:
    return name.replace("_", " ")
