"""The deploy files, checked without a Docker engine or a cluster (``make compose-test``,
scripts/compose_test.py, runs the real stack where an engine is available).

- Dockerfile: hadolint passes; multi-stage, non-root, the pinned torch; build-only inputs (CA
  bundle, local wheels) stay in the build stage; .dockerignore keeps the build context to what
  is copied; ENTRYPOINT + CMD and the HEALTHCHECK run here (``slow``); ``make image`` resolves
  the CPU and the CUDA variant (the CUDA base cannot be pulled here: its command line is
  checked).
- docker-compose.yml: the compose-spec schema accepts it; the topology is the promised one
  (password-protected Redis, loopback-published replicas advertising their service names,
  read-only root file systems); every ``command``, ``entrypoint`` and ``healthcheck`` runs
  against local servers (real redis-server, real ``oldlogit serve``, the demo trainer and
  rollout worker), with only ports, host names and paths rewritten (``slow``, as is the same
  for the TLS override).
- deploy/k8s: ``kubectl kustomize`` builds each overlay, ``kubernetes-validate`` accepts it for
  the pinned Kubernetes version (deploy/k8s/KUBERNETES_VERSION; ``slow``), and the probes,
  grace period, selectors, ConfigMap (valid ``Settings``), HPA and GPU resources are what they
  should be.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from oldlogit import Client

from .conftest import REPO, start_cli

pytestmark = pytest.mark.e2e

BIN = Path(sys.executable).parent  # the venv's console scripts: oldlogit, hadolint, kubectl...
K8S_VERSION = (REPO / "deploy" / "k8s" / "KUBERNETES_VERSION").read_text().strip()
OVERLAYS = sorted(p.name for p in (REPO / "deploy" / "k8s" / "overlays").iterdir())
TOKEN = "compose-test-token"


def tool(name: str) -> str:
    """A CLI from the venv (the dev extra) or PATH; skipped where absent, failed in CI."""
    found = BIN / name if (BIN / name).exists() else shutil.which(name)
    if found is None:
        if os.environ.get("CI"):
            pytest.fail(f"{name} is missing in CI: .ci/run must install it")
        pytest.skip(f"needs {name} (the dev extra / .ci/run install it)")
    return str(found)


def run(argv: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=REPO, **kw)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---------------------------------------------------------------------------- Dockerfile


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    buf = ""
    for line in (REPO / "Dockerfile").read_text().splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        buf += line.rstrip("\\").strip() + " " if line.endswith("\\") else line.strip()
        if not line.endswith("\\"):
            word, _, rest = buf.partition(" ")
            out.append((word.upper(), rest.strip()))
            buf = ""
    return out


def dockerignored(path: str) -> bool:
    """Docker's rule, for the patterns used here: the last matching line wins, and a pattern
    that matches a directory matches everything under it."""
    ignored = False
    for raw in (REPO / ".dockerignore").read_text().splitlines():
        pat = raw.strip()
        if not pat or pat.startswith("#"):
            continue
        negate = pat.startswith("!")
        pat = pat.lstrip("!").rstrip("/")
        rx = re.escape(pat).replace(r"\*\*/", "(.*/)?").replace(r"\*", "[^/]*")
        rx = rx.replace(r"\?", "[^/]").replace(r"\[", "[").replace(r"\]", "]")
        parts = path.split("/")
        if any(re.fullmatch(rx, "/".join(parts[:i])) for i in range(1, len(parts) + 1)):
            ignored = not negate
    return ignored


def test_hadolint_passes_and_would_catch_a_bad_dockerfile(tmp_path: Path) -> None:
    hadolint = tool("hadolint")
    out = run([hadolint, "Dockerfile"])
    assert out.returncode == 0, out.stdout + out.stderr
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python\nRUN apt-get install curl\n")  # untagged base, no -y/pins
    assert run([hadolint, str(bad)]).returncode != 0


def test_dockerfile_is_multistage_non_root_with_the_pinned_torch() -> None:
    ins = dockerfile()
    kinds = [k for k, _ in ins]
    assert kinds.count("FROM") >= 2 and any(k == "COPY" and a.startswith("--from=") for k, a in ins)
    first_from = kinds.index("FROM")
    assert ("ARG", "BASE_IMAGE=python:3.11-slim-bookworm") in ins[:first_from]
    assert ins[first_from][1].startswith("${BASE_IMAGE}")
    last_stage = ins[len(kinds) - 1 - kinds[::-1].index("FROM") :]
    args = dict(a.split("=", 1) for k, a in last_stage if k == "ARG" and "=" in a)
    (user,) = [a for k, a in last_stage if k == "USER"]
    user = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], user)
    assert user not in ("0", "root") and user.isdigit()  # numeric: runAsNonRoot can verify it
    assert json.loads(dict(ins)["ENTRYPOINT"]) == ["oldlogit"]
    pinned = re.search(r"torch==[\w.]+", (REPO / "constraints.txt").read_text())
    assert pinned is not None
    assert any(k == "RUN" and pinned.group(0) in a for k, a in ins), "torch pin differs"
    assert any(k == "ARG" and a.startswith("TORCH_INDEX=") for k, a in ins)


def stages() -> dict[str, list[tuple[str, str]]]:
    """The Dockerfile's instructions per stage name (``FROM ... AS name``)."""
    out: dict[str, list[tuple[str, str]]] = {}
    name = ""
    for k, a in dockerfile():
        if k == "FROM":
            name = a.split()[-1]
        out.setdefault(name, []).append((k, a))
    return out


def test_build_inputs_stay_in_the_build_stage() -> None:
    """The CA bundle and local wheels of deploy/docker/build-extras reach the build stage only;
    every pip install there is pinned by constraints.txt (no unpinned torch, no CUDA wheels)."""
    st = stages()
    assert set(st) >= {"base", "build", "runtime"}
    assert any(k == "COPY" and "build-extras" in a for k, a in st["build"])
    for name in ("base", "runtime"):
        assert not any("build-extras" in a or "pip.conf" in a for _, a in st[name]), name
    (carried,) = [a for k, a in st["runtime"] if k == "COPY"]
    assert carried.split() == ["--from=build", "/opt/venv", "/opt/venv"]
    installs = [a for k, a in dockerfile() if k == "RUN" and "pip install" in a]
    assert installs and all(
        a.count("pip install") == a.count("-c constraints.txt") for a in installs
    )
    assert not dockerignored("deploy/docker/build-extras/ca.pem")
    assert not dockerignored("deploy/docker/build-extras/torch-2.13.0+cpu-cp311-x.whl")
    assert dockerignored("deploy/docker/README.md")


@pytest.mark.parametrize("variant", ["cpu", "cuda"])
def test_make_image_builds_each_variant(variant: str) -> None:
    """`make image` (scripts/build_image.sh) for both variants, without building: the CUDA base
    cannot be pulled here, so its command line is what is checked."""
    env = {"PATH": os.environ["PATH"], "VARIANT": variant}
    out = run(["bash", "scripts/build_image.sh", "--dry-run"], env=env)
    assert out.returncode == 0, out.stderr
    cmd = out.stdout.strip().splitlines()[-1].split()
    args = dict(cmd[i + 1].split("=", 1) for i, w in enumerate(cmd) if w == "--build-arg")
    tag = cmd[cmd.index("-t") + 1]
    if variant == "cpu":
        assert (args["BASE_IMAGE"], tag) == ("python:3.11-slim-bookworm", "oldlogit:latest")
        assert args["TORCH_INDEX"].endswith("/whl/cpu")
    else:
        assert args["BASE_IMAGE"].startswith("nvidia/cuda:") and "runtime" in args["BASE_IMAGE"]
        assert (args["TORCH_INDEX"].rsplit("/", 1)[1], tag) == ("cu128", "oldlogit:latest-cuda")
    assert cmd[-1] == "."
    bad = run(["bash", "scripts/build_image.sh", "--dry-run"], env={**env, "VARIANT": "tpu"})
    assert bad.returncode == 2


def test_dockerignore_keeps_exactly_what_the_image_copies() -> None:
    sources = [
        src
        for k, a in dockerfile()
        if k == "COPY" and not a.startswith("--from=")
        for src in a.split()[:-1]
    ]
    assert sources
    for src in sources:
        path = REPO / src
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
        kept = [f for f in files if not dockerignored(str(f.relative_to(REPO)))]
        assert kept, f"{src} is excluded from the build context"
        for f in kept:
            assert "__pycache__" not in f.parts and not f.name.endswith(".pyc"), f
    for rel in (
        "service/oldlogit_service/static/status.js",
        "service/oldlogit_service/server.py",
        "client/oldlogit/py.typed",
    ):
        assert not dockerignored(rel), rel
    for rel in (".venv/bin/python", "tests/conftest.py", ".git/HEAD", "snapshots/x"):
        assert dockerignored(rel), rel


# `slow` (an `oldlogit serve --demo` start from the image's environment: ~12 s on 2 cores). The
# default run checks the Dockerfile statically (above), starts `oldlogit serve --demo`
# (tests/e2e/test_cli.py) and reads settings from OLDLOGIT_* variables (tests/unit).
@pytest.mark.slow
def test_image_entrypoint_and_healthcheck_run(tmp_path: Path) -> None:
    ins = dockerfile()
    env = {}
    for k, a in ins:
        if k == "ENV":
            env.update(re.findall(r"(\w+)=(\S+)", a))
    entry = json.loads(dict(ins)["ENTRYPOINT"])
    cmd = json.loads(dict(ins)["CMD"])
    health = dict(ins)["HEALTHCHECK"]
    health_cmd = json.loads(health[health.index("CMD ") + 4 :])
    # The image's own environment, but on loopback, free ports and a temporary snapshot dir.
    env.update(
        OLDLOGIT_HOST="127.0.0.1",
        OLDLOGIT_HTTP_PORT="0",
        OLDLOGIT_GRPC_PORT="0",
        OLDLOGIT_SNAPSHOT_DIR=str(tmp_path / "snap"),
        PATH=f"{BIN}:{os.environ['PATH']}",
    )
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    assert entry == ["oldlogit"] and cmd[0] == "serve"
    srv = start_cli(cmd[1:], env=env)  # `oldlogit serve --demo`, the CLI a user runs
    try:
        port = srv.http.rsplit(":", 1)[1]
        argv = [sys.executable if a == "python" else a for a in health_cmd]
        ok = run(argv, env={**os.environ, "OLDLOGIT_HTTP_PORT": port})
        assert ok.returncode == 0, ok.stderr
        down = run(argv, env={**os.environ, "OLDLOGIT_HTTP_PORT": str(free_port())})
        assert down.returncode != 0  # nothing listens there: unhealthy
    finally:
        assert srv.stop() == 0


# ---------------------------------------------------------------------------- compose

_VAR = re.compile(r"\$\$|\$\{(\w+)(?:(:?[-?])([^}]*))?\}")


def interpolate(node: Any, env: dict[str, str]) -> Any:
    """Compose's variable syntax, for the forms used: ${V}, ${V:-default}, ${V:?error}."""
    if isinstance(node, dict):
        return {k: interpolate(v, env) for k, v in node.items()}
    if isinstance(node, list):
        return [interpolate(v, env) for v in node]
    if not isinstance(node, str):
        return node

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name, op, arg = m.groups()
        value = env.get(name, "")
        if op in (":?", "?") and not value:
            raise KeyError(f"{name}: {arg}")
        return value if value or op is None else arg

    return _VAR.sub(sub, node)


def compose(env: dict[str, str]) -> dict[str, Any]:
    raw = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    return dict(interpolate(raw, env))


def test_compose_file_passes_the_compose_spec_schema(tmp_path: Path) -> None:
    checker = tool("check-jsonschema")
    schema = ["--builtin-schema", "vendor.compose-spec"]
    out = run([checker, *schema, "docker-compose.yml"])
    assert out.returncode == 0, out.stdout + out.stderr
    broken = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    broken["services"]["redis-cache"]["healthcheck"]["tset"] = ["CMD", "true"]  # a typo
    (tmp_path / "compose.yml").write_text(yaml.safe_dump(broken))
    assert run([checker, *schema, str(tmp_path / "compose.yml")]).returncode != 0


SECRETS = {"OLDLOGIT_WRITE_TOKEN": "t", "OLDLOGIT_REDIS_PASSWORD": "p", "OLDLOGIT_MODEL_DIR": "/m"}


def test_compose_topology() -> None:
    for required in SECRETS:  # secrets and the model are required, never defaulted
        with pytest.raises(KeyError, match=required):
            compose({k: v for k, v in SECRETS.items() if k != required})
    raw = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    assert "name" not in raw  # docker-compose 1.29 refuses a top-level name
    services = compose(SECRETS)["services"]
    registry = services["redis-registry"]["command"]
    cache = services["redis-cache"]["command"]
    assert registry[registry.index("--maxmemory-policy") + 1] == "noeviction"
    assert cache[cache.index("--maxmemory-policy") + 1] == "allkeys-lru" and "--maxmemory" in cache
    for name in ("redis-registry", "redis-cache"):
        s = services[name]
        assert s["command"][s["command"].index("--requirepass") + 1] == "p"
        assert s["environment"]["REDISCLI_AUTH"] == "p"  # the healthcheck authenticates
        assert "ports" not in s  # reachable inside the project network only
    servers = [n for n, s in services.items() if s.get("command", [None])[0] == "serve"]
    replicas = [n for n in servers if not services[n].get("profiles")]
    assert replicas == ["oldlogit-1", "oldlogit-2"]
    # The tensor-parallel variant: one container, N ranks, its own registry and volume.
    assert [n for n in servers if n not in replicas] == ["oldlogit-tp"]
    tp = services["oldlogit-tp"]
    assert tp["profiles"] == ["tensor-parallel"]
    assert tp["environment"]["OLDLOGIT_TENSOR_PARALLEL"] == "2"
    assert tp["environment"]["OLDLOGIT_REDIS_URL"] == ""
    assert "snapshots-tp:/snapshots" in tp["volumes"]
    for name in replicas:
        s = services[name]
        env = s["environment"]
        assert "snapshots:/snapshots" in s["volumes"]  # one shared snapshot volume
        assert env["OLDLOGIT_WRITE_TOKEN"] == "t"
        assert env["OLDLOGIT_REDIS_URL"] == "redis://:p@redis-registry:6379/0"
        assert env["OLDLOGIT_CACHE_REDIS_URL"] == "redis://:p@redis-cache:6379/0"
        assert not any("redis://" in w for w in s["command"])  # no password in `ps`
        # Others reach it by its service name, and its store directory survives re-creation.
        assert env["OLDLOGIT_ADVERTISE_HOST"] == env["OLDLOGIT_REPLICA_ID"] == name
        # Probes on the plain probe port (works with TLS on), which is never published.
        assert "OLDLOGIT_HEALTH_PORT" in s["healthcheck"]["test"][-1]
        assert not any(p.endswith(":" + env["OLDLOGIT_HEALTH_PORT"]) for p in s["ports"])
        drain = float(env["OLDLOGIT_DRAIN_TIMEOUT_S"])
        assert float(s["stop_grace_period"].rstrip("s")) > drain
        # Published on the host's loopback unless asked otherwise.
        assert all(p.startswith("127.0.0.1:") for p in s["ports"]), s["ports"]
        public = compose({**SECRETS, "OLDLOGIT_PUBLISH_ADDR": "0.0.0.0"})["services"][name]
        assert all(p.startswith("0.0.0.0:") for p in public["ports"])
    assert {p.split(":")[1] for n in replicas for p in services[n]["ports"]} == {
        "8000", "8001", "50051", "50052"
    }  # fmt: skip
    for name, s in services.items():
        assert s["healthcheck"]["test"][0] == "CMD", name
        assert s["read_only"] is True, name
        for dep, cond in s.get("depends_on", {}).items():
            assert cond == {"condition": "service_healthy"}, (name, dep)
            assert "healthcheck" in services[dep]
    assert services["trainer"]["profiles"] == services["rollout-worker"]["profiles"] == ["demo"]


class RedisFromCompose:
    """A compose Redis service's redis-server command line, on a free loopback port."""

    def __init__(self, service: dict[str, Any], tmp: Path) -> None:
        cmd = service["command"]
        assert cmd[0] == "redis-server"
        self.env = service.get("environment", {})  # REDISCLI_AUTH, as in the container
        self.port = free_port()
        tmp.mkdir()
        self.proc = subprocess.Popen(
            [tool("redis-server"), *cmd[1:], "--port", str(self.port), "--bind", "127.0.0.1"],
            cwd=tmp,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        end = time.monotonic() + 20
        while not self.answers():
            assert self.proc.poll() is None and time.monotonic() < end, "redis did not start"
            time.sleep(0.1)

    def cli(self, *args: str, auth: bool = True) -> str:
        env = {k: v for k, v in os.environ.items() if k != "REDISCLI_AUTH"}
        if auth:
            env.update(self.env)
        return run([tool("redis-cli"), "-p", str(self.port), *args], env=env).stdout

    def answers(self) -> bool:
        return self.cli("ping").strip() == "PONG"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=20)


@contextmanager
def redis_pair(services: dict[str, Any], tmp: Path) -> Iterator[dict[str, RedisFromCompose]]:
    started: dict[str, RedisFromCompose] = {}
    try:
        for name in ("redis-registry", "redis-cache"):
            started[name] = RedisFromCompose(services[name], tmp / name)
        yield started
    finally:
        for r in started.values():
            r.stop()


# `slow` (~40 s on 2 cores: the Redis pair, a replica, the trainer and rollout worker, a TP 2
# replica). The default run checks the compose file statically (schema, topology) and runs
# the image's entrypoint and healthcheck; `make compose-test` runs the stack in Docker.
@pytest.mark.slow
def test_every_compose_command_runs_against_local_servers(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    env = {
        "OLDLOGIT_WRITE_TOKEN": TOKEN,
        "OLDLOGIT_REDIS_PASSWORD": "compose-test-password",
        "OLDLOGIT_MODEL_DIR": str(tiny_model_dir),
    }
    services = compose(env)["services"]
    todo = {(n, k) for n, s in services.items() for k in ("command", "entrypoint", "healthcheck")}
    todo &= {(n, k) for n, s in services.items() for k in s}
    done: set[tuple[str, str]] = set()
    # Only ports, host names and paths change; every other word runs as written.
    subs = {"/examples/": f"{REPO}/examples/compose/", "0.0.0.0": "127.0.0.1"}

    def argv(words: list[str]) -> list[str]:
        out = []
        for w in words:
            for old, new in subs.items():
                w = w.replace(old, new)
            out.append(sys.executable if w == "python" else w)
        return out

    def healthcheck(name: str, env: dict[str, str] | None = None) -> int:
        words = services[name]["healthcheck"]["test"][1:]
        if words[0] == "redis-cli":
            words = [words[0], "-p", str(redis[name].port), *words[1:]]
        done.add((name, "healthcheck"))
        # The service's own environment, as the container has it (REDISCLI_AUTH for Redis).
        own = {k: v for k, v in services[name].get("environment", {}).items() if k != "HOME"}
        return run(argv(words), env={**os.environ, **own, **(env or {})}).returncode

    with redis_pair(services, tmp_path) as redis:
        for name, policy in (("redis-registry", "noeviction"), ("redis-cache", "allkeys-lru")):
            assert policy in redis[name].cli("config", "get", "maxmemory-policy").split()
            assert "NOAUTH" in redis[name].cli("ping", auth=False)  # the password is enforced
            done.add((name, "command"))
            assert healthcheck(name) == 0, name
        subs.update(
            {
                "redis-registry:6379": f"127.0.0.1:{redis['redis-registry'].port}",
                "redis-cache:6379": f"127.0.0.1:{redis['redis-cache'].port}",
                "/snapshots": str(tmp_path / "snapshots"),
                "/model": str(tiny_model_dir),
                "/tmp/heartbeat": str(tmp_path / "heartbeat"),
            }
        )
        replica_cmds = {json.dumps(services[n]["command"]) for n in ("oldlogit-1", "oldlogit-2")}
        assert len(replica_cmds) == 1  # the two replicas run the same command line
        cmd = argv(services["oldlogit-1"]["command"])
        for flag in ("--http-port", "--grpc-port"):
            cmd[cmd.index(flag) + 1] = "0"
        assert cmd[0] == "serve"
        # The replica's environment (Redis URLs with the password, advertise host...), with
        # the same host rewrites; HOME stays this machine's.
        replica_env = {
            k: argv([v])[0] for k, v in services["oldlogit-1"]["environment"].items() if k != "HOME"
        }
        replica_env["OLDLOGIT_HEALTH_PORT"] = "0"  # the probe port, free here
        srv = start_cli(cmd[1:], env=replica_env)
        try:
            done |= {("oldlogit-1", "command"), ("oldlogit-2", "command")}
            port = {"OLDLOGIT_HEALTH_PORT": health_port(srv.lines)}
            assert healthcheck("oldlogit-1", port) == healthcheck("oldlogit-2", port) == 0
            subs.update(
                {
                    "oldlogit-1:8000": srv.http,
                    "oldlogit-2:8000": srv.http,
                    "oldlogit-1:50051": srv.grpc,
                    "oldlogit-2:50051": srv.grpc,
                }
            )
            env = {**os.environ, "OLDLOGIT_WRITE_TOKEN": TOKEN}
            for name, bounded in (
                ("trainer", ["--steps", "2", "--interval-s", "0"]),
                ("rollout-worker", ["--rounds", "3", "--interval-s", "0"]),
            ):
                (tmp_path / "heartbeat").unlink(missing_ok=True)
                assert healthcheck(name) != 0  # no heartbeat yet: not healthy
                s = services[name]
                out = run(argv(s["entrypoint"] + s["command"]) + bounded, env=env)
                assert out.returncode == 0, (name, out.stdout, out.stderr)
                done |= {(name, "entrypoint"), (name, "command")}
                assert healthcheck(name) == 0, name
            with Client(f"http://{srv.http}") as c:
                assert [v.policy_version for v in c.versions()] == [0, 1, 2]  # the trainer's
            stale = time.time() - 120  # a loop that stopped making progress is unhealthy
            os.utime(tmp_path / "heartbeat", (stale, stale))
            assert healthcheck("rollout-worker") != 0
            # Liveness never depends on Redis: with the registry gone, /healthz still answers.
            redis["redis-registry"].stop()
            assert not redis["redis-registry"].answers()
            assert httpx.get(f"http://{srv.http}/healthz", timeout=10).status_code == 200
        finally:
            assert srv.stop() == 0
        # The tensor-parallel variant: its command and environment start 2 ranks here.
        tp = services["oldlogit-tp"]
        cmd = argv(tp["command"])
        for flag in ("--http-port", "--grpc-port"):
            cmd[cmd.index(flag) + 1] = "0"
        tp_env = {k: argv([v])[0] for k, v in tp["environment"].items() if k != "HOME"}
        tp_env["OLDLOGIT_HEALTH_PORT"] = "0"
        srv = start_cli(cmd[1:], env=tp_env)
        try:
            done.add(("oldlogit-tp", "command"))
            port = {"OLDLOGIT_HEALTH_PORT": health_port(srv.lines)}
            assert healthcheck("oldlogit-tp", port) == 0
        finally:
            assert srv.stop() == 0
    assert done == todo, f"not run: {todo - done}"


def health_port(lines: list[str]) -> str:
    """The probe port `oldlogit serve` printed (``health=HOST:PORT``)."""
    (found,) = [ln.split("=", 1)[1] for ln in lines if ln.startswith("health=")]
    return found.rsplit(":", 1)[1]


def merge_override(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Compose's rule for the keys the TLS override uses: ``environment`` maps merge (the
    override wins), ``volumes`` merge by mount path, anything else is replaced."""
    services = {name: dict(s) for name, s in base["services"].items()}
    for name, extra in override["services"].items():
        s = services[name]
        for key, value in extra.items():
            if key == "environment":
                s[key] = {**s.get(key, {}), **value}
            elif key == "volumes":
                by_target = {v.split(":")[1]: v for v in [*s.get(key, []), *value]}
                s[key] = list(by_target.values())
            else:
                s[key] = value
    return {**base, "services": services}


@pytest.mark.slow  # a mutual-TLS replica, trainer and rollout worker: ~20 s on 2 cores
def test_compose_tls_override(tmp_path: Path, tiny_model_dir: Path) -> None:
    """docker-compose.tls.yml: schema-valid, its TLS directory required, and, merged onto
    docker-compose.yml, the replica's command serves mutual TLS on both ports from the mounted
    files; the healthcheck passes on the plain probe port while plain HTTP on the API port
    fails; the demo trainer and rollout worker run with their TLS command lines."""
    from ..tls_certs import CertAuthority

    checker = tool("check-jsonschema")
    out = run([checker, "--builtin-schema", "vendor.compose-spec", "docker-compose.tls.yml"])
    assert out.returncode == 0, out.stdout + out.stderr
    raw = yaml.safe_load((REPO / "docker-compose.tls.yml").read_text())
    assert "name" not in raw
    with pytest.raises(KeyError, match="OLDLOGIT_TLS_DIR"):
        interpolate(raw, SECRETS)
    tls_dir = tmp_path / "tls"
    ca = CertAuthority(tls_dir, "compose CA")
    for stem, client in (("tls", False), ("client", True)):
        pair = ca.issue(stem, client=client)
        pair.cert.rename(tls_dir / f"{stem}.crt")
        pair.key.rename(tls_dir / f"{stem}.key")
    ca.pem.rename(tls_dir / "ca.crt")
    env = {
        **SECRETS,
        "OLDLOGIT_TLS_DIR": str(tls_dir),
        "OLDLOGIT_TLS_CLIENT_CA_FILE": "/tls/ca.crt",
        "OLDLOGIT_MODEL_DIR": str(tiny_model_dir),
        "OLDLOGIT_WRITE_TOKEN": TOKEN,
    }
    merged = merge_override(compose(env), interpolate(raw, env))["services"]
    for name in ("oldlogit-1", "oldlogit-2", "trainer", "rollout-worker"):
        assert f"{tls_dir}:/tls:ro" in merged[name]["volumes"], name
    r1 = merged["oldlogit-1"]
    assert r1["healthcheck"] == compose(env)["services"]["oldlogit-1"]["healthcheck"]
    assert "OLDLOGIT_REDIS_URL" in r1["environment"]  # the base's settings are kept
    # One replica here, without Redis (the compose test above runs the Redis pair).
    subs = {"/tls/": f"{tls_dir}/", "/snapshots": str(tmp_path / "snap"), "0.0.0.0": "127.0.0.1"}
    subs["/model"] = str(tiny_model_dir)

    def rewrite(word: str) -> str:
        for old, new in subs.items():
            word = word.replace(old, new)
        return word

    renv = {k: rewrite(v) for k, v in r1["environment"].items() if "REDIS" not in k}
    renv.pop("HOME")
    renv["OLDLOGIT_HEALTH_PORT"] = "0"
    cmd = [rewrite(w) for w in r1["command"]]
    for flag in ("--http-port", "--grpc-port"):
        cmd[cmd.index(flag) + 1] = "0"
    probe = ssl.create_default_context(cafile=str(tls_dir / "ca.crt"))
    probe.load_cert_chain(tls_dir / "client.crt", tls_dir / "client.key")
    srv = start_cli(cmd[1:], env=renv, tls=probe)
    try:
        words = r1["healthcheck"]["test"][1:]
        argv = [sys.executable if w == "python" else w for w in words]
        http_only = {**os.environ, "OLDLOGIT_HTTP_PORT": srv.http.rsplit(":", 1)[1]}
        ok = run(argv, env={**http_only, "OLDLOGIT_HEALTH_PORT": health_port(srv.lines)})
        assert ok.returncode == 0, ok.stderr
        assert run(argv, env=http_only).returncode != 0  # plain HTTP to the TLS port: no
        subs.update(
            {
                "oldlogit-1:8000": srv.http,
                "oldlogit-2:8000": srv.http,
                "oldlogit-1:50051": srv.grpc,
                "oldlogit-2:50051": srv.grpc,
                "/examples/": f"{REPO}/examples/compose/",
                "/tmp/heartbeat": str(tmp_path / "heartbeat"),
            }
        )
        for name, bounded in (
            ("trainer", ["--steps", "1", "--interval-s", "0"]),
            ("rollout-worker", ["--rounds", "2", "--interval-s", "0"]),
        ):
            s = merged[name]
            words = [rewrite(w) for w in s["entrypoint"] + s["command"]] + bounded
            out = run(
                [sys.executable if w == "python" else w for w in words],
                env={**os.environ, "OLDLOGIT_WRITE_TOKEN": TOKEN},
            )
            assert out.returncode == 0, (name, out.stdout[-2000:], out.stderr[-2000:])
    finally:
        assert srv.stop() == 0


# ---------------------------------------------------------------------------- Kubernetes


def kustomize(overlay: str) -> list[dict[str, Any]]:
    out = run([tool("kubectl"), "kustomize", f"deploy/k8s/overlays/{overlay}"])
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    (doc,) = [d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    return doc


# `slow` (~6 s on 2 cores): `make validate-deploy`, which CI runs, builds and validates every
# overlay the same way; the default run builds each and checks what it says (below).
@pytest.mark.slow
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_builds_and_validates(overlay: str, tmp_path: Path) -> None:
    validator = tool("kubernetes-validate")
    docs = kustomize(overlay)
    path = tmp_path / f"{overlay}.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    cmd = [validator, "--strict", "--kubernetes-version", K8S_VERSION]
    out = run([*cmd, str(path)])
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count(" passed ") == len(docs)
    # The validator is not a rubber stamp: an unknown field fails under --strict.
    one(docs, "Deployment", "oldlogit")["spec"]["template"]["spec"]["containers"][0]["prob"] = 1
    path.write_text(yaml.safe_dump_all(docs))
    assert run([*cmd, str(path)]).returncode != 0


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_semantics(overlay: str) -> None:
    from oldlogit_service.config import Settings, is_wildcard

    docs = kustomize(overlay)
    dep = one(docs, "Deployment", "oldlogit")
    pod = dep["spec"]["template"]["spec"]
    labels = dep["spec"]["template"]["metadata"]["labels"]
    (c,) = pod["containers"]
    config = one(docs, "ConfigMap")
    assert c["envFrom"][0]["configMapRef"]["name"] == config["metadata"]["name"]
    env = config["data"]
    # Every key is a setting (extra=forbid), and together they are a valid Settings.
    settings = Settings(**{k.removeprefix("OLDLOGIT_").lower(): v for k, v in env.items()})
    # Bound to every interface, so the replica advertises its pod IP (the downward API), or
    # with TLS its DNS name under the headless Service (a certificate can name that).
    assert is_wildcard(settings.host)
    names = [e["name"] for e in c["env"]]
    (advertise,) = [e for e in c["env"] if e["name"] == "OLDLOGIT_ADVERTISE_HOST"]
    if settings.tls_enabled:
        assert advertise["value"] == "$(POD_NAME).oldlogit-headless.$(POD_NAMESPACE).svc"
        assert "valueFrom" not in advertise and pod["subdomain"] == "oldlogit-headless"
        for var, field in (("POD_NAME", "metadata.name"), ("POD_NAMESPACE", "metadata.namespace")):
            # $(VAR) expands only variables defined earlier in the list.
            assert names.index(var) < names.index("OLDLOGIT_ADVERTISE_HOST")
            (e,) = [e for e in c["env"] if e["name"] == var]
            assert e["valueFrom"] == {"fieldRef": {"fieldPath": field}}
    else:
        assert advertise["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {
        "http": settings.http_port,
        "grpc": settings.grpc_port,
        "health": settings.health_port,
    }
    # Probes: slow first loads, readiness = can serve, liveness independent of Redis; all on
    # the plain probe port, so TLS and mutual TLS change nothing for the kubelet.
    assert c["startupProbe"]["failureThreshold"] * c["startupProbe"]["periodSeconds"] >= 600
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"]["port"] == "health", probe
        assert c[probe]["httpGet"].get("scheme", "HTTP") == "HTTP", probe
    # TLS: the Secret mounted read-only where the settings look for the files.
    if settings.tls_enabled:
        assert settings.tls_cert_file is not None and settings.tls_key_file is not None
        (tls_mount,) = [m for m in c["volumeMounts"] if m["name"] == "tls"]
        assert tls_mount["readOnly"] is True
        files = [settings.tls_cert_file, settings.tls_key_file, settings.tls_client_ca_file]
        for f in files:
            assert f is None or str(f.parent) == tls_mount["mountPath"], f
        secret = {v["name"]: v for v in pod["volumes"]}["tls"]["secret"]
        assert secret["secretName"] == "oldlogit-tls"
        annotations = dep["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scheme"] == "https"
        assert (settings.tls_client_ca_file is not None) == overlay.endswith("mtls")
    pre_stop = int(c["lifecycle"]["preStop"]["exec"]["command"][1])
    assert pod["terminationGracePeriodSeconds"] > pre_stop + settings.drain_timeout_s + 5
    # Storage: the RWX claim is what the pods mount, and the settings' paths are on it.
    pvc = one(docs, "PersistentVolumeClaim")
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    claim = {v["name"]: v for v in pod["volumes"]}["data"]["persistentVolumeClaim"]
    assert claim["claimName"] == pvc["metadata"]["name"]
    mount = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}["data"]
    assert str(settings.snapshot_dir).startswith(mount + "/")
    # Services, PDB and HPA select and target these pods.
    selects = lambda sel: all(labels.get(k) == v for k, v in sel.items())  # noqa: E731
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    assert services["oldlogit-headless"]["spec"]["clusterIP"] == "None"
    for name in ("oldlogit", "oldlogit-headless"):
        assert selects(services[name]["spec"]["selector"])
    assert selects(one(docs, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"])
    hpa = one(docs, "HorizontalPodAutoscaler")["spec"]
    assert hpa["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "oldlogit",
    }
    assert hpa["metrics"][0]["pods"]["metric"]["name"] == "oldlogit_queue_wait_seconds"
    tp = settings.tensor_parallel
    if tp > 1:  # one replica over its ranks: its own registry, never scaled out
        assert hpa["minReplicas"] == hpa["maxReplicas"] == dep["spec"]["replicas"] == 1
        assert settings.redis_url is None and settings.tp_chunks % tp == 0
    else:
        assert hpa["minReplicas"] >= 2
    # Redis: the URLs name the in-cluster services; registry never evicts, cache is LRU.
    for url, name, policy in (
        *([(settings.redis_url, "oldlogit-redis-registry", "noeviction")] if tp == 1 else []),
        (settings.cache_redis_url, "oldlogit-redis-cache", "allkeys-lru"),
    ):
        assert url is not None and url.startswith(f"redis://{name}:6379/")
        assert name in services
        (rc,) = [
            d
            for d in docs
            if d["kind"] in ("Deployment", "StatefulSet") and d["metadata"]["name"] == name
        ]
        args = rc["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[args.index("--maxmemory-policy") + 1] == policy
    gpus = c["resources"]["limits"].get("nvidia.com/gpu")
    if overlay.startswith("gpu"):
        assert settings.device == "cuda" and gpus == tp  # one GPU per rank
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
            "tolerations"
        ]
    else:
        assert settings.device == "cpu" and gpus is None and "tolerations" not in pod
