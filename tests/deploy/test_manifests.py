"""Keep ``deploy/`` from drifting away from the code.

Checks every Kubernetes manifest, the Slurm script, the systemd units and env file, the Dockerfile
and the deploy README against ``hangwatch/config.py`` (ports, environment variable names) and
against the CLI contract (``hangwatch.cli.build_parser()``): every ``hangwatch <subcommand> ...``
written anywhere under ``deploy/`` must parse.
"""

from __future__ import annotations

import argparse
import configparser
import contextlib
import importlib
import io
import json
import re
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from hangwatch import config

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "kubernetes"
SBATCH = DEPLOY / "slurm" / "hangwatch.sbatch"
SYSTEMD = DEPLOY / "systemd"
ENV_FILE = SYSTEMD / "hangwatch.env"
DOCKERFILE = DEPLOY / "container" / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
README = DEPLOY / "README.md"

COORDINATOR_SERVICE = "hangwatch-coordinator"
TOKEN_SECRET = "hangwatch-token"
#: Subcommands the brief promises; free text (scripts, README) is only scanned for these.
KNOWN_SUBCOMMANDS = ("coordinator", "agent")
#: Values that must never be on a command line (visible to every user through ps / hostPID).
SECRET_FLAGS = ("--token",)

ENV_NAMES = {value for name, value in vars(config).items() if name.startswith("ENV_")}
ENV_REF = re.compile(r"(?<![A-Za-z0-9_])HANGWATCH_[A-Z0-9_]+")
SHELL_OPERATORS = set("();<>|&")


# --- loading -----------------------------------------------------------------------------------


def _k8s_docs() -> list[tuple[Path, dict[str, Any]]]:
    docs: list[tuple[Path, dict[str, Any]]] = []
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                assert isinstance(doc, dict), f"{path.name}: a YAML document is not a mapping"
                docs.append((path, doc))
    return docs


def _find(kind: str, name: str | None = None) -> dict[str, Any]:
    found = [
        doc
        for _, doc in _k8s_docs()
        if doc.get("kind") == kind and (name is None or doc.get("metadata", {}).get("name") == name)
    ]
    assert len(found) == 1, f"expected exactly one {kind} {name or ''} in deploy/kubernetes, found {len(found)}"
    return found[0]


def _pod_specs(node: Any) -> Iterator[dict[str, Any]]:
    """Every pod spec (a mapping with a ``containers`` list) anywhere inside ``node``."""
    if isinstance(node, dict):
        if isinstance(node.get("containers"), list):
            yield node
        for value in node.values():
            yield from _pod_specs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _pod_specs(value)


def _containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return [c for spec in _pod_specs(doc) for c in spec["containers"]]


def _only_container(doc: dict[str, Any]) -> dict[str, Any]:
    containers = _containers(doc)
    assert len(containers) == 1, f"{doc['kind']} {doc['metadata']['name']}: expected one container"
    return containers[0]


def _pod_spec(doc: dict[str, Any]) -> dict[str, Any]:
    specs = list(_pod_specs(doc))
    assert len(specs) == 1, f"{doc['kind']} {doc['metadata']['name']}: expected one pod spec"
    return specs[0]


def _env(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def _expand_k8s(text: str, container: dict[str, Any]) -> str:
    """Kubernetes ``$(VAR)`` expansion from the container's literal env values."""
    env = _env(container)

    def sub(match: re.Match[str]) -> str:
        entry = env.get(match.group(1), {})
        return str(entry["value"]) if "value" in entry else match.group(0)

    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", sub, text)


def _argv(container: dict[str, Any]) -> list[str]:
    return [_expand_k8s(str(t), container) for t in [*container.get("command", []), *container.get("args", [])]]


def _flag(argv: list[str], flag: str) -> str | None:
    """The value of ``flag`` in ``argv`` (``--flag value`` or ``--flag=value``)."""
    for i, token in enumerate(argv):
        if token == flag and i + 1 < len(argv):
            return argv[i + 1]
        if token.startswith(flag + "="):
            return token.split("=", 1)[1]
    return None


def _namespace() -> str:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    return str(kustomization["namespace"])


def _systemd_unit(name: str) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None, comment_prefixes=("#", ";"))
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string((SYSTEMD / name).read_text(), source=name)
    return parser


def _env_file() -> dict[str, str]:
    values: dict[str, str] = {}
    for number, line in enumerate(ENV_FILE.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        assert sep and re.fullmatch(r"[A-Z_][A-Z0-9_]*", key), f"{ENV_FILE.name}:{number}: not KEY=VALUE"
        values[key] = value
    return values


def _join_continuations(text: str) -> list[tuple[int, str]]:
    """Logical lines (backslash continuations joined) with the number of their first line."""
    lines: list[tuple[int, str]] = []
    buffer: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), 1):
        if not buffer:
            start = number
        if raw.rstrip().endswith("\\"):
            buffer.append(raw.rstrip()[:-1])
            continue
        buffer.append(raw)
        lines.append((start, " ".join(part.strip() for part in buffer)))
        buffer = []
    if buffer:
        lines.append((start, " ".join(buffer)))
    return lines


def _dockerfile() -> list[tuple[int, str, str]]:
    """(line, INSTRUCTION, rest) for every instruction of the Dockerfile."""
    out = []
    for number, line in _join_continuations(DOCKERFILE.read_text()):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        instruction, _, rest = stripped.partition(" ")
        out.append((number, instruction.upper(), rest.strip()))
    return out


def _readme_code() -> list[tuple[int, str]]:
    """Lines inside fenced code blocks of deploy/README.md."""
    lines: list[tuple[int, str]] = []
    inside = False
    for number, line in _join_continuations(README.read_text()):
        if line.strip().startswith("```"):
            inside = not inside
        elif inside:
            lines.append((number, line))
    return lines


# --- hangwatch command lines -------------------------------------------------------------------


@dataclass(frozen=True)
class Command:
    where: str  #: file:line or file:object, for messages
    argv: tuple[str, ...]  #: starts with the subcommand
    certain: bool  #: from a structured place (k8s command, ExecStart, ENTRYPOINT+CMD)


_PROGRAM = re.compile(r"(?:\S*/)?hangwatch(?::[\w.\-]+)?")


def _shell_tokens(line: str) -> list[str]:
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = ""
    try:
        return list(lexer)
    except ValueError:  # unbalanced quotes in prose: not a command line
        return []


def _commands_in_tokens(tokens: list[str], where: str, certain: bool) -> list[Command]:
    found = []
    for i, token in enumerate(tokens[:-1]):
        if not _PROGRAM.fullmatch(token):
            continue
        sub = tokens[i + 1]
        if not (certain or sub in KNOWN_SUBCOMMANDS):
            continue
        argv: list[str] = []
        for rest in tokens[i + 1 :]:
            if set(rest) <= SHELL_OPERATORS:
                if rest[0] in "<>" and argv and argv[-1].isdigit():
                    argv.pop()  # the fd of a redirection such as 2>&1
                break
            argv.append(rest)
        found.append(Command(where, tuple(argv), certain))
        if certain:
            break
    return found


def _all_commands() -> list[Command]:
    commands: list[Command] = []
    # Kubernetes: container command + args, $(VAR) expanded.
    for path, doc in _k8s_docs():
        for container in _containers(doc):
            where = f"{path.name}:{doc['kind']}/{doc['metadata']['name']}/{container['name']}"
            argv = _argv(container)
            if argv and _PROGRAM.fullmatch(argv[0]):
                commands.append(Command(where, tuple(argv[1:]), True))
            for token in argv:  # a `sh -c "..."` script
                if " " in token:
                    commands += _commands_in_tokens(_shell_tokens(token), where, False)
    # Slurm: every non-comment logical line.
    for number, line in _join_continuations(SBATCH.read_text()):
        if not line.lstrip().startswith("#"):
            commands += _commands_in_tokens(_shell_tokens(line), f"{SBATCH.name}:{number}", False)
    # systemd: ExecStart (leading -@:+! prefixes are systemd's, not the program's).
    for unit in sorted(SYSTEMD.glob("*.service")):
        for key in ("ExecStart", "ExecStartPre", "ExecStartPost", "ExecReload"):
            value = _systemd_unit(unit.name)["Service"].get(key)
            if value:
                tokens = shlex.split(value.lstrip("-@:+!"))
                commands += _commands_in_tokens(tokens, f"{unit.name}:{key}", _PROGRAM.fullmatch(tokens[0]) is not None)
    # Dockerfile: ENTRYPOINT + CMD of the final stage, and `docker run` examples in comments.
    entrypoint: list[str] = []
    cmd: list[str] = []
    for _, instruction, rest in _dockerfile():
        if instruction == "FROM":
            entrypoint, cmd = [], []
        elif instruction == "ENTRYPOINT":
            entrypoint = json.loads(rest) if rest.startswith("[") else ["/bin/sh", "-c", rest]
        elif instruction == "CMD":
            cmd = json.loads(rest) if rest.startswith("[") else ["/bin/sh", "-c", rest]
    full = [*entrypoint, *cmd]
    if full and _PROGRAM.fullmatch(full[0]):
        commands.append(Command(f"{DOCKERFILE.name}:ENTRYPOINT+CMD", tuple(full[1:]), True))
    for number, line in _join_continuations(DOCKERFILE.read_text()):
        text = line.strip().lstrip("#")
        if "docker run" in text:
            commands += _commands_in_tokens(_shell_tokens(text), f"{DOCKERFILE.name}:{number}", False)
    # README code blocks.
    for number, line in _readme_code():
        commands += _commands_in_tokens(_shell_tokens(line), f"{README.name}:{number}", False)
    return commands


COMMANDS = _all_commands()


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise AssertionError("hangwatch.cli.build_parser() has no subcommands")


def _placeholder(action: argparse.Action | None) -> str:
    """A value the option's type accepts, standing in for a shell/systemd/k8s variable."""
    if action is None:
        return "placeholder"
    if action.choices:
        return str(next(iter(action.choices)))
    if not callable(action.type):
        return "placeholder"
    for candidate in ("1", "127.0.0.1:1", "placeholder"):
        try:
            action.type(candidate)
        except Exception:
            continue
        return candidate
    return "placeholder"


def _substitute(sub: argparse.ArgumentParser, argv: tuple[str, ...]) -> list[str]:
    options = sub._option_string_actions
    out: list[str] = []
    for i, token in enumerate(argv):
        if "$" not in token and "%" not in token:
            out.append(token)
        elif token.startswith("--") and "=" in token:
            flag = token.split("=", 1)[0]
            out.append(f"{flag}={_placeholder(options.get(flag))}")
        else:
            previous = argv[i - 1] if i else ""
            out.append(_placeholder(options.get(previous)))
    return out


def _literal_port(value: str | None) -> int | None:
    if value is None or "$" in value:
        return None
    return int(value.rpartition(":")[2])


# --- tests: files parse ------------------------------------------------------------------------


def test_every_kubernetes_yaml_parses_into_named_objects() -> None:
    docs = _k8s_docs()
    assert docs, "no YAML under deploy/kubernetes"
    for path, doc in docs:
        assert doc.get("apiVersion") and doc.get("kind"), f"{path.name}: document without apiVersion/kind"
        if doc["kind"] != "Kustomization":
            assert doc.get("metadata", {}).get("name"), f"{path.name}: {doc['kind']} without metadata.name"


def test_kustomization_deploys_the_stack_but_not_the_examples() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    resources = kustomization["resources"]
    for resource in resources:
        assert (K8S / resource).is_file(), f"kustomization.yaml lists missing file {resource}"
    assert {"coordinator.yaml", "agent-daemonset.yaml"} <= set(resources)
    # The example Secret carries a placeholder token: applying it would deploy a known secret.
    for example in ("secret.example.yaml", "training-pod-example.yaml"):
        assert example not in resources, f"kustomization.yaml must not deploy the example {example}"
    images = {image["name"] for image in kustomization.get("images", [])}
    for path, doc in _k8s_docs():
        if path.name in resources:
            for container in _containers(doc):
                name = container["image"].rsplit(":", 1)[0]
                assert name in images, f"{path.name}: image {name} not overridable in kustomization images"


def test_kustomize_build_renders() -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed")
    result = subprocess.run([kubectl, "kustomize", str(K8S)], capture_output=True, text=True, timeout=20, check=False)
    assert result.returncode == 0, f"kubectl kustomize deploy/kubernetes failed:\n{result.stderr}"
    kinds = {doc["kind"] for doc in yaml.safe_load_all(result.stdout) if doc}
    assert {"Deployment", "Service", "PersistentVolumeClaim", "DaemonSet"} <= kinds


def test_sbatch_is_valid_bash() -> None:
    result = subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, f"bash -n {SBATCH.name}:\n{result.stderr}"
    assert SBATCH.read_text().startswith("#!/bin/bash\n"), "sbatch script must start with #!/bin/bash"


@pytest.mark.parametrize("unit", ["hangwatch-coordinator.service", "hangwatch-agent.service"])
def test_systemd_unit_parses_and_runs_hangwatch(unit: str) -> None:
    parsed = _systemd_unit(unit)
    for section in ("Unit", "Service", "Install"):
        assert parsed.has_section(section), f"{unit}: no [{section}] section"
    exec_start = shlex.split(parsed["Service"]["ExecStart"].lstrip("-@:+!"))
    subcommand = unit.removeprefix("hangwatch-").removesuffix(".service")
    assert Path(exec_start[0]).name == "hangwatch" and exec_start[1] == subcommand, (
        f"{unit}: ExecStart must run `hangwatch {subcommand}`, got {exec_start[:2]}"
    )
    env_file = parsed["Service"]["EnvironmentFile"].lstrip("-")
    assert Path(env_file).name == ENV_FILE.name, f"{unit}: EnvironmentFile should be the example {ENV_FILE.name}"
    # Every variable ExecStart expands must come from the env file or Environment=.
    defined = set(_env_file())
    for assignment in shlex.split(parsed["Service"].get("Environment", "")):
        defined.add(assignment.split("=", 1)[0])
    for name in re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", parsed["Service"]["ExecStart"]):
        assert name in defined, f"{unit}: ExecStart uses ${name}, which {ENV_FILE.name} does not define"


# --- tests: ports and names match the code ----------------------------------------------------


def test_coordinator_service_and_container_ports_match_config() -> None:
    deployment = _find("Deployment", COORDINATOR_SERVICE)
    service = _find("Service", COORDINATOR_SERVICE)
    container = _only_container(deployment)
    container_ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    expected = {"grpc": config.DEFAULT_PORT, "metrics": config.DEFAULT_METRICS_PORT}
    assert container_ports == expected, f"coordinator containerPorts {container_ports} != config defaults {expected}"
    service_ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert set(service_ports) == set(expected), f"Service ports {sorted(service_ports)} != {sorted(expected)}"
    for name, port in expected.items():
        entry = service_ports[name]
        target = entry.get("targetPort", entry["port"])
        target = container_ports.get(target, target) if isinstance(target, str) else target
        assert entry["port"] == port, f"Service port {name}={entry['port']}, config says {port}"
        assert target == port, f"Service port {name} targets {target}, the container listens on {port}"
    argv = _argv(container)
    assert _literal_port(_flag(argv, "--port")) in (None, config.DEFAULT_PORT), "--port != DEFAULT_PORT"
    assert _literal_port(_flag(argv, "--metrics-port")) in (None, config.DEFAULT_METRICS_PORT), (
        "--metrics-port != DEFAULT_METRICS_PORT"
    )
    for probe in ("readinessProbe", "livenessProbe"):
        assert probe in container, f"coordinator has no {probe}"
        grpc_probe = container[probe].get("grpc")
        assert grpc_probe, f"coordinator {probe} must be a grpc: probe (grpc.health.v1)"
        port = container_ports.get(grpc_probe["port"], grpc_probe["port"])
        assert port == config.DEFAULT_PORT, f"{probe} probes port {port}, not the gRPC port"
    annotations = deployment["spec"]["template"]["metadata"].get("annotations", {})
    if "prometheus.io/port" in annotations:
        assert int(annotations["prometheus.io/port"]) == config.DEFAULT_METRICS_PORT


def test_service_selects_the_coordinator_pods() -> None:
    deployment = _find("Deployment", COORDINATOR_SERVICE)
    service = _find("Service", COORDINATOR_SERVICE)
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    for selector, what in (
        (service["spec"]["selector"], "Service selector"),
        (deployment["spec"]["selector"]["matchLabels"], "Deployment selector"),
    ):
        assert selector.items() <= labels.items(), f"{what} {selector} does not match pod labels {labels}"
    daemonset = _find("DaemonSet")
    agent_labels = daemonset["spec"]["template"]["metadata"]["labels"]
    assert not service["spec"]["selector"].items() <= agent_labels.items(), "Service would select agents"


def test_coordinator_deployment_shape() -> None:
    deployment = _find("Deployment", COORDINATOR_SERVICE)
    assert deployment["spec"]["replicas"] == 1, "one coordinator: it owns the SQLite store"
    assert deployment["spec"].get("strategy", {}).get("type") == "Recreate", (
        "RollingUpdate would run two coordinators on one ReadWriteOnce volume"
    )
    container = _only_container(deployment)
    argv = _argv(container)
    assert _flag(argv, "--host") == "0.0.0.0", "the coordinator must bind 0.0.0.0 in a pod"
    token = _env(container).get(config.ENV_TOKEN, {})
    assert token.get("valueFrom", {}).get("secretKeyRef"), "the coordinator's token must come from a Secret"
    # --data-dir (or HANGWATCH_DATA_DIR) must be the mounted PersistentVolumeClaim.
    data_dir = _flag(argv, "--data-dir") or _env(container).get(config.ENV_DATA_DIR, {}).get("value")
    assert data_dir, "coordinator has no --data-dir / HANGWATCH_DATA_DIR"
    pod = _pod_spec(deployment)
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert data_dir in mounts, f"data dir {data_dir} is not a volumeMount"
    claim = volumes[mounts[data_dir]].get("persistentVolumeClaim", {}).get("claimName")
    assert claim, f"data dir {data_dir} is not backed by a PersistentVolumeClaim"
    _find("PersistentVolumeClaim", claim)
    assert pod.get("securityContext", {}).get("runAsNonRoot") is True, "the coordinator runs as non-root"


def test_agent_daemonset_can_see_and_ptrace_ranks() -> None:
    daemonset = _find("DaemonSet")
    pod = _pod_spec(daemonset)
    assert pod.get("hostPID") is True, "agent DaemonSet needs hostPID: true to see the training pods"
    container = _only_container(daemonset)
    security = container.get("securityContext", {})
    capabilities = security.get("capabilities", {})
    assert "SYS_PTRACE" in capabilities.get("add", []), "agent needs capabilities.add: [SYS_PTRACE]"
    assert "SYS_PTRACE" not in capabilities.get("drop", []), "agent drops SYS_PTRACE"
    # Added capabilities reach only a root container's effective set.
    run_as = security.get("runAsUser", pod.get("securityContext", {}).get("runAsUser"))
    assert run_as in (None, 0), f"agent runs as uid {run_as}: SYS_PTRACE would not be effective"
    assert security.get("runAsNonRoot") is not True, "runAsNonRoot: true contradicts the root agent"
    argv = _argv(container)
    assert argv[:2] == ["hangwatch", "agent"], f"agent container runs {argv[:2]}"
    node_name = _flag(container.get("args", []), "--node-name")
    if node_name is not None:
        var = re.fullmatch(r"\$\((\w+)\)", node_name)
        assert var, "--node-name should come from the downward API"
        field = _env(container)[var.group(1)]["valueFrom"]["fieldRef"]["fieldPath"]
        assert field == "spec.nodeName", f"--node-name comes from {field}, not spec.nodeName"


def _assert_points_at_coordinator(addr: str, where: str, need_namespace: bool) -> None:
    host, _, port = addr.rpartition(":")
    labels = host.split(".")
    assert labels[0] == COORDINATOR_SERVICE, f"{where}: {addr} is not the {COORDINATOR_SERVICE} Service"
    if need_namespace or len(labels) > 1:
        assert len(labels) > 1 and labels[1] == _namespace(), (
            f"{where}: {addr} names namespace {labels[1:2]}, kustomization deploys to {_namespace()}"
        )
    if len(labels) > 2:
        assert labels[2] == "svc", f"{where}: {addr} is not a Service DNS name (<svc>.<ns>.svc...)"
    service = _find("Service", COORDINATOR_SERVICE)
    grpc = next(p for p in service["spec"]["ports"] if p["name"] == "grpc")
    assert int(port) == grpc["port"] == config.DEFAULT_PORT, (
        f"{where}: {addr} uses port {port}, the Service's gRPC port is {grpc['port']}"
    )


def test_agent_reaches_the_coordinator_service() -> None:
    container = _only_container(_find("DaemonSet"))
    addr = _flag(_argv(container), "--coordinator")
    assert addr and "$(" not in addr, "agent --coordinator must resolve to a literal address"
    _assert_points_at_coordinator(addr, "agent --coordinator", need_namespace=False)
    env_addr = _env(container).get(config.ENV_ADDR, {}).get("value")
    if env_addr is not None:
        _assert_points_at_coordinator(env_addr, f"agent {config.ENV_ADDR}", need_namespace=False)


def test_training_example_attaches_ranks_to_the_coordinator() -> None:
    docs = [doc for path, doc in _k8s_docs() if path.name == "training-pod-example.yaml"]
    containers = [c for doc in docs for c in _containers(doc)]
    assert containers, "training-pod-example.yaml has no containers"
    for container in containers:
        env = _env(container)
        addr = env.get(config.ENV_ADDR, {}).get("value")
        assert addr, f"training container {container['name']} does not set {config.ENV_ADDR}"
        relay = re.fullmatch(r"\$\((\w+)\):(\d+)", addr)
        if relay:  # the node's own relaying agent: the node's IP and the agent's hostPort
            field = env[relay.group(1)]["valueFrom"]["fieldRef"]["fieldPath"]
            assert field == "status.hostIP", f"training {config.ENV_ADDR} host comes from {field}, not status.hostIP"
            agent = _only_container(_find("DaemonSet"))
            host_ports = {p.get("hostPort") for p in agent.get("ports", [])}
            assert int(relay.group(2)) in host_ports, f"no agent hostPort {relay.group(2)} (have {host_ports})"
            assert _flag(_argv(agent), "--relay-port") == relay.group(2), "agent --relay-port != the ranks' port"
            assert _flag(_argv(agent), "--relay-host") == "0.0.0.0", "the relay must listen beyond loopback"
            assert int(relay.group(2)) == config.DEFAULT_RELAY_PORT
        else:
            # The training job runs in its own namespace: the address must name the coordinator's.
            _assert_points_at_coordinator(addr, f"training {config.ENV_ADDR}", need_namespace=True)
        token = env.get(config.ENV_TOKEN, {}).get("valueFrom", {}).get("secretKeyRef", {})
        assert token.get("name") == TOKEN_SECRET, f"training container must read {config.ENV_TOKEN} from a Secret"
        assert "torchrun" in " ".join(_argv(container)), "the training example should run torchrun"


def _host_dir_of(pod: dict[str, Any], container: dict[str, Any], path: str) -> str | None:
    """The node directory (hostPath) that ``path`` in ``container`` lies in, if any."""
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    for mount in container.get("volumeMounts", []):
        inside = mount["mountPath"].rstrip("/") + "/"
        host = volumes.get(mount["name"], {}).get("hostPath", {}).get("path")
        if host and path.startswith(inside):
            return host.rstrip("/") + "/" + path[len(inside) :]
    return None


def test_ranks_link_to_their_nodes_agent_through_a_shared_host_directory() -> None:
    """A rank's records outlive it only if it hands its ring to the node's agent: the agent's
    --rank-socket and every training container's HANGWATCH_AGENT_SOCKET must be one file on
    the node, through hostPath mounts of the same directory, and the agent must see the ranks'
    processes (hostPID) to prove who linked and to reach their worker servers."""
    daemonset = _find("DaemonSet")
    agent_pod, agent = _pod_spec(daemonset), _only_container(daemonset)
    socket_in_agent = _flag(_argv(agent), "--rank-socket")
    assert socket_in_agent, "the agent DaemonSet does not serve rank links (--rank-socket)"
    on_node = _host_dir_of(agent_pod, agent, socket_in_agent)
    assert on_node, f"agent --rank-socket {socket_in_agent} is not in a hostPath mount: no rank can reach it"
    assert agent_pod.get("hostPID") is True
    mode = _flag(_argv(agent), "--rank-socket-mode")
    assert mode is None or int(mode, 8) & ~0o666 == 0
    docs = [doc for path, doc in _k8s_docs() if path.name == "training-pod-example.yaml"]
    pods = [pod for doc in docs for pod in _pod_specs(doc)]
    assert len(pods) >= 2  # the master and the workers
    for pod in pods:
        for container in pod["containers"]:
            socket_in_rank = _env(container).get(config.ENV_AGENT_SOCKET, {}).get("value")
            assert socket_in_rank, f"training container {container['name']} sets no {config.ENV_AGENT_SOCKET}"
            assert _host_dir_of(pod, container, socket_in_rank) == on_node, (
                f"ranks link to {socket_in_rank}, which is not the agent's {on_node} on the node"
            )


def test_secret_references_match_the_example_secret() -> None:
    secret = _find("Secret", TOKEN_SECRET)
    keys = set(secret.get("stringData", {})) | set(secret.get("data", {}))
    for path, doc in _k8s_docs():
        for container in _containers(doc):
            for entry in container.get("env", []):
                ref = entry.get("valueFrom", {}).get("secretKeyRef")
                if ref and not ref.get("optional"):
                    assert ref["name"] == TOKEN_SECRET and ref["key"] in keys, (
                        f"{path.name}: {entry['name']} reads secret {ref['name']}/{ref['key']}, "
                        f"secret.example.yaml defines {TOKEN_SECRET}/{sorted(keys)}"
                    )
    token_refs = [
        _env(c).get(config.ENV_TOKEN, {})
        for doc in (_find("Deployment", COORDINATOR_SERVICE), _find("DaemonSet"))
        for c in _containers(doc)
    ]
    assert all(ref.get("valueFrom", {}).get("secretKeyRef") for ref in token_refs), (
        f"coordinator and agent must both read {config.ENV_TOKEN} from the Secret"
    )


def _deploy_files() -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*") if p.is_file() and "__pycache__" not in p.parts)


def test_every_hangwatch_env_var_is_a_config_constant() -> None:
    unknown = []
    for path in _deploy_files():
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for name in ENV_REF.findall(line):
                if name not in ENV_NAMES:
                    unknown.append(f"{path.relative_to(ROOT)}:{number}: {name}")
    assert not unknown, "HANGWATCH_* names not defined in hangwatch/config.py (ENV_* constants):\n" + "\n".join(unknown)


def test_env_file_points_at_the_default_port() -> None:
    values = _env_file()
    assert config.ENV_TOKEN in values, f"{ENV_FILE.name} must define {config.ENV_TOKEN}"
    addr = values.get(config.ENV_ADDR)
    assert addr, f"{ENV_FILE.name} must define {config.ENV_ADDR} (the agent's --coordinator)"
    assert _literal_port(addr) == config.DEFAULT_PORT, f"{config.ENV_ADDR}={addr}: not port {config.DEFAULT_PORT}"


def test_sbatch_wires_coordinator_agents_and_ranks() -> None:
    text = SBATCH.read_text()
    lines = [line for _, line in _join_continuations(text) if not line.lstrip().startswith("#")]
    defaults = dict(re.findall(r"^(\w+)=\$\{\1:-([^}]*)\}", text, re.MULTILINE))
    assert int(defaults["HW_PORT"]) == config.DEFAULT_PORT, "sbatch HW_PORT default != DEFAULT_PORT"
    assert int(defaults["HW_METRICS_PORT"]) in (0, config.DEFAULT_METRICS_PORT)

    def first(predicate: str) -> int:
        matches = [i for i, line in enumerate(lines) if re.search(predicate, line)]
        assert matches, f"{SBATCH.name}: no line matching {predicate!r}"
        return matches[0]

    coordinator = first(r"\bhangwatch coordinator\b")
    assert "--host 0.0.0.0" in lines[coordinator] and lines[coordinator].rstrip().endswith("&"), (
        "the coordinator must bind 0.0.0.0 and run in the background"
    )
    agents = first(r"\bsrun\b.*\bhangwatch agent\b")
    assert "--overlap" in lines[agents] and "--ntasks-per-node=1" in lines[agents], (
        "agents: one per node, overlapping the training step"
    )
    training = first(r"\bsrun\b.*\btorchrun\b")
    export_addr = first(rf"^\s*export {config.ENV_ADDR}=")
    assert coordinator < agents < training and export_addr < training, "order: coordinator, agents, training"
    assert re.search(rf"^\s*export {config.ENV_TOKEN}\b", text, re.MULTILINE), "the job token must be exported"
    assert re.search(r"^\s*trap \S+ EXIT", text, re.MULTILINE), "no cleanup trap on EXIT"
    # Ranks reach either the agents' coordinator, or their own node's agent on its relay port.
    agent_argv = _shell_tokens(lines[agents])
    agent_addr = _flag(agent_argv, "--coordinator")
    relay_port = _flag(agent_argv, "--relay-port")
    allowed = {agent_addr} | ({f"127.0.0.1:{relay_port}"} if relay_port else set())
    exports = [line for line in lines if re.match(rf"^\s*export {config.ENV_ADDR}=", line)]
    for line in exports:
        rank_addr = line.split("=", 1)[1].split("#")[0].strip().strip('"').replace("${", "$").replace("}", "")
        assert rank_addr in {a.replace("${", "$").replace("}", "") for a in allowed if a}, (
            f"ranks use {rank_addr}, agents serve {allowed}"
        )
    assert int(defaults["HW_RELAY_PORT"]) in (0, config.DEFAULT_RELAY_PORT)


# --- tests: Dockerfile ------------------------------------------------------------------------


def test_dockerfile_base_user_and_ports() -> None:
    instructions = _dockerfile()
    bases = [rest.split()[0] for _, ins, rest in instructions if ins == "FROM"]
    assert bases and all(base == "python:3.11-slim" for base in bases), f"base images {bases}"
    final = max(i for i, (_, ins, _) in enumerate(instructions) if ins == "FROM")
    users = [rest for _, ins, rest in instructions[final:] if ins == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0"), "the final image must run as non-root"
    exposed = {int(port.split("/")[0]) for _, ins, rest in instructions if ins == "EXPOSE" for port in rest.split()}
    assert exposed == {config.DEFAULT_PORT, config.DEFAULT_METRICS_PORT}, f"EXPOSE {exposed}"


def test_container_install_does_not_pull_torch() -> None:
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    torchy = [d for d in project["dependencies"] if re.match(r"torch\b", d)]
    assert not torchy, f"base dependencies pull torch: {torchy}"
    pip_runs = 0
    for number, ins, rest in _dockerfile():
        if ins != "RUN":
            continue
        segment: list[str] = []
        for token in [*_shell_tokens(rest), "&&"]:
            if not set(token) <= SHELL_OPERATORS:
                segment.append(token)
                continue
            if any(Path(t).name.startswith("pip") for t in segment[:3]) and {"install", "wheel"} & set(segment):
                pip_runs += 1
                bad = [t for t in segment if "torch" in t or "[" in t or t in ("-r", "--requirement")]
                assert not bad, f"Dockerfile:{number}: pip may pull torch or extras: {bad}"
            segment = []
    assert pip_runs, "no pip install/wheel found in the Dockerfile"


def test_dockerfile_copies_what_the_wheel_needs() -> None:
    tomllib = pytest.importorskip("tomllib")
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    wheel = pyproject["tool"]["hatch"]["build"]["targets"]["wheel"]
    needed = {
        "pyproject.toml",
        pyproject["project"]["readme"],
        *wheel["only-include"],
        *wheel["force-include"],
    }
    copied: set[str] = set()
    for _, ins, rest in _dockerfile():
        if ins == "COPY" and "--from" not in rest:
            copied |= {src.rstrip("/") for src in rest.split()[:-1]}
    missing = needed - copied
    assert not missing, f"Dockerfile does not COPY {sorted(missing)} (pyproject.toml wheel sources)"
    ignored = [line.strip() for line in DOCKERIGNORE.read_text().splitlines() if line.strip()]
    ignored = [line for line in ignored if not line.startswith("#")]
    clash = sorted(n for n in needed if any(Path(n).match(pattern) for pattern in ignored))
    assert not clash, f".dockerignore excludes files the build copies: {clash}"


# --- tests: the CLI contract ------------------------------------------------------------------


def test_command_lines_were_found() -> None:
    found = {(c.where.split(":")[0], c.argv[0]) for c in COMMANDS if c.argv}
    expected = {
        ("coordinator.yaml", "coordinator"),
        ("agent-daemonset.yaml", "agent"),
        (SBATCH.name, "coordinator"),
        (SBATCH.name, "agent"),
        ("hangwatch-coordinator.service", "coordinator"),
        ("hangwatch-agent.service", "agent"),
        (DOCKERFILE.name, "coordinator"),
    }
    assert expected <= found, f"expected hangwatch command lines not found: {sorted(expected - found)}"


def test_no_secret_or_insecure_flag_on_command_lines() -> None:
    for command in COMMANDS:
        for flag in (*SECRET_FLAGS, "--allow-insecure-bind"):
            assert not any(t == flag or t.startswith(flag + "=") for t in command.argv), (
                f"{command.where}: {flag} on a command line (use {config.ENV_TOKEN} in the environment)"
            )


def test_literal_ports_on_command_lines_match_config() -> None:
    for command in COMMANDS:
        argv = list(command.argv)
        for flag, allowed in (
            ("--port", {config.DEFAULT_PORT}),
            ("--metrics-port", {0, config.DEFAULT_METRICS_PORT}),
            ("--coordinator", {config.DEFAULT_PORT}),
        ):
            port = _literal_port(_flag(argv, flag))
            assert port is None or port in allowed, f"{command.where}: {flag} uses port {port}, not {allowed}"


def _build_parser() -> argparse.ArgumentParser:
    try:
        cli = importlib.import_module("hangwatch.cli")
    except ImportError as error:
        pytest.fail(f"hangwatch.cli is not importable ({error}): cannot check deploy/ command lines")
    parser = cli.build_parser()
    assert isinstance(parser, argparse.ArgumentParser)
    return parser


@pytest.mark.parametrize("command", COMMANDS, ids=[f"{c.where}:{' '.join(c.argv[:1])}" for c in COMMANDS])
def test_command_line_is_accepted_by_the_cli(command: Command) -> None:
    parser = _build_parser()
    subparsers = _subparsers(parser)
    assert command.argv, f"{command.where}: `hangwatch` without a subcommand"
    name = command.argv[0]
    assert name in subparsers, f"{command.where}: unknown subcommand {name!r} (have {sorted(subparsers)})"
    argv = [name, *_substitute(subparsers[name], command.argv[1:])]
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        try:
            parser.parse_args(argv)
        except SystemExit as exit_:
            if exit_.code not in (0, None):
                pytest.fail(
                    f"{command.where}: `hangwatch {' '.join(command.argv)}` rejected by the CLI:\n{stderr.getvalue()}"
                )


def test_the_agent_credential_reaches_coordinator_and_agents_never_ranks() -> None:
    for doc in (_find("Deployment", COORDINATOR_SERVICE), _find("DaemonSet")):
        for c in _containers(doc):
            ref = _env(c).get(config.ENV_AGENT_TOKEN, {}).get("valueFrom", {}).get("secretKeyRef")
            assert ref == {"name": TOKEN_SECRET, "key": "agent-token"}, c.get("name")
    for path, doc in _k8s_docs():
        if doc.get("kind") in ("Deployment", "DaemonSet"):
            continue
        for c in _containers(doc):
            assert config.ENV_AGENT_TOKEN not in _env(c), f"{path.name}: a training pod must not hold it"
    sbatch = (DEPLOY / "slurm" / "hangwatch.sbatch").read_text()
    agent = sbatch.index("hangwatch agent --coordinator")
    assert sbatch.index("export HANGWATCH_AGENT_TOKEN") < agent < sbatch.index("unset HANGWATCH_AGENT_TOKEN")
    assert sbatch.index("unset HANGWATCH_AGENT_TOKEN") < sbatch.index("torchrun --nnodes")
    assert "HANGWATCH_AGENT_TOKEN=" in (DEPLOY / "systemd" / "hangwatch.env").read_text()
