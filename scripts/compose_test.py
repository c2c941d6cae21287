"""`make compose-test`: the whole docker-compose.yml brought up and checked as a user would.

In: a Docker engine and Compose (v2 `docker compose`, or docker-compose 1.29). Out: one line
per named step, then one summary line with the timing; exit 0 only if every step passed.
Builds (or reuses) the images, starts the stack under a fresh project name with a tiny model,
checks it, and always tears it down (containers, networks, volumes). Host-side traffic goes to
127.0.0.1 only (the published ports are bound there); the rest stays inside the project's own
network. Not part of `make test`: .ci/run calls it when a Docker engine can be started.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np

REPO = Path(__file__).resolve().parents[1]
REPLICAS = ("oldlogit-1", "oldlogit-2")
REDIS = ("redis-registry", "redis-cache")
DEMO = ("trainer", "rollout-worker")
REDIS_IMAGE = "redis:7.4-alpine"
LOCAL_REDIS_IMAGE = "oldlogit-local/redis:7-bookworm"  # scripts/make_base_images.sh
UID = "10001"  # the Dockerfile's user


class StepFailed(Exception):
    pass


def check(cond: object, message: str) -> None:
    if not cond:
        raise StepFailed(message)


def sh(argv: list[str], *, timeout: float = 300, check_rc: bool = True, **kw: Any) -> str:
    out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)
    if check_rc and out.returncode != 0:
        raise StepFailed(f"{' '.join(argv)} exited {out.returncode}: {out.stderr[-2000:]}")
    return str(out.stdout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(what: str, pred: Callable[[], bool], timeout_s: float, every_s: float = 1.0) -> None:
    end = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > end:
            raise StepFailed(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(every_s)


def compose_command() -> list[str]:
    """Compose v2 (the docker CLI plugin) if present, else docker-compose (1.29)."""
    probe = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True)
    if probe.returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    raise StepFailed("neither `docker compose` (v2) nor `docker-compose` is installed")


class Stack:
    """One compose project: its environment, its containers, and the commands a user runs."""

    def __init__(self, compose: list[str], env: dict[str, str], project: str) -> None:
        self.compose = [*compose, "-p", project, "-f", str(REPO / "docker-compose.yml")]
        self.env = env
        self.project = project
        self.token = env["OLDLOGIT_WRITE_TOKEN"]
        ports = {
            name: (int(env[f"OLDLOGIT_{i}_HTTP_PORT"]), int(env[f"OLDLOGIT_{i}_GRPC_PORT"]))
            for i, name in enumerate(REPLICAS, 1)
        }
        self.http = {n: f"http://127.0.0.1:{p[0]}" for n, p in ports.items()}
        self.grpc = {n: f"grpc://127.0.0.1:{p[1]}" for n, p in ports.items()}

    def run(self, *args: str, timeout: float = 300, profile: bool = False) -> str:
        prof = ["--profile", "demo"] if profile else []
        return sh([*self.compose, *prof, *args], env=self.env, cwd=REPO, timeout=timeout)

    def container(self, service: str) -> str:
        ids = self.run("ps", "-a", "-q", service, profile=service in DEMO).split()
        check(ids, f"no container for {service}")
        return ids[0]

    def inspect(self, service: str) -> dict[str, Any]:
        return dict(json.loads(sh(["docker", "inspect", self.container(service)]))[0])

    def health(self, service: str) -> str:
        state = self.inspect(service)["State"]
        return str(state.get("Health", {}).get("Status", state["Status"]))

    def wait_healthy(self, services: tuple[str, ...], timeout_s: float = 300) -> None:
        def all_healthy() -> bool:
            states = {s: self.health(s) for s in services}
            bad = [s for s, h in states.items() if h in ("unhealthy", "exited", "dead")]
            check(not bad, f"{bad} became {[states[s] for s in bad]}")
            return all(h == "healthy" for h in states.values())

        wait_for(f"{', '.join(services)} healthy", all_healthy, timeout_s, every_s=2)

    def logs(self, *services: str, tail: int = 40) -> str:
        return sh(
            [
                *self.compose,
                "--profile",
                "demo",
                "logs",
                "--no-color",
                "--tail",
                str(tail),
                *services,
            ],
            env=self.env,
            cwd=REPO,
            check_rc=False,
        )

    def down(self) -> None:
        """Remove everything the project made, and check that nothing is left: containers,
        named volumes and the containers' anonymous volumes."""
        label = f"label=com.docker.compose.project={self.project}"
        ids = sh(["docker", "ps", "-aq", "--filter", label]).split()
        mounted = {
            m["Name"]
            for c in (json.loads(sh(["docker", "inspect", *ids])) if ids else [])
            for m in c["Mounts"]
            if m["Type"] == "volume"
        }
        self.run("down", "-v", "--remove-orphans", "-t", "5", profile=True, timeout=180)
        left = sh(["docker", "ps", "-aq", "--filter", label]).split()
        check(not left, f"containers left: {left}")
        volumes = set(sh(["docker", "volume", "ls", "-q"]).split())
        named = set(sh(["docker", "volume", "ls", "-q", "--filter", label]).split())
        check(not (mounted & volumes) and not named, f"volumes left: {(mounted & volumes) | named}")


# ------------------------------------------------------------------------------ the checks


def tiny_model(workdir: Path) -> Path:
    from oldlogit_service.demo.tiny import make_tiny_model_dir

    model = make_tiny_model_dir(workdir / "model", vocab_size=512, hidden_size=64, num_layers=2)
    for p in [workdir, *workdir.rglob("*")]:  # the containers read it as uid 10001
        p.chmod(0o755 if p.is_dir() else 0o644)
    return model


def new_weights(model_dir: Path, seed: int) -> dict[str, Any]:
    """A trainer's next version: every weight moved a little, in the serving dtype."""
    import torch
    from safetensors.torch import load_file

    g = torch.Generator().manual_seed(seed)
    base = load_file(str(model_dir / "model.safetensors"))
    return {
        k: (t.float() + 0.02 * torch.randn(t.shape, generator=g)).to(torch.bfloat16)
        for k, t in base.items()
    }


def sequences(n: int, length: int, vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [rng.integers(1, vocab, size=length).tolist() for _ in range(n)]


def answers(url: str, token: str, seqs: list[list[int]], version: int) -> list[np.ndarray]:
    """Logprobs computed by the replica at ``url`` (never the shared result cache)."""
    from oldlogit import Client

    out = []
    with Client(url, token=token) as c:
        for ids in seqs:
            r = c.logprobs(
                ids, policy_version=version, score_from=4, temperature=0.7, use_cache=False
            )
            check(r.exact and not r.cached and r.versions == [version], f"{url}: {r}")
            out.append(np.asarray(r.logprobs, dtype=np.float32))
    return out


def same_bits(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(
        x.shape == y.shape and np.array_equal(x.view(np.uint32), y.view(np.uint32))
        for x, y in zip(a, b, strict=True)
    )


class Run:
    def __init__(self, stack: Stack, model_dir: Path, image: str) -> None:
        self.stack = stack
        self.model_dir = model_dir
        self.image = image
        self.acked: dict[int, str] = {}  # version -> sha256 acknowledged to a publisher
        self.reference: dict[int, list[np.ndarray]] = {}  # version -> logprobs of SEQS
        self.seqs: list[list[int]] = []
        self.victim = REPLICAS[0]  # the replica the failover step kills

    # -- steps ---------------------------------------------------------------------------
    def up(self) -> str:
        self.stack.run("up", "-d", "--no-build", timeout=600)
        self.stack.wait_healthy(REDIS + REPLICAS)
        for name in REPLICAS:
            ports = self.stack.inspect(name)["NetworkSettings"]["Ports"]
            hosts = {b["HostIp"] for binds in ports.values() for b in binds or []}
            check(hosts == {"127.0.0.1"}, f"{name} publishes on {hosts}")
        for name in REDIS:
            ports = self.stack.inspect(name)["NetworkSettings"]["Ports"]
            check(not any(ports.values()), f"{name} publishes a port on the host: {ports}")
        return "2 Redis + 2 replicas healthy; replica ports on 127.0.0.1 only, Redis unpublished"

    def publish_and_read(self) -> str:
        from oldlogit import Client

        s = self.stack
        with Client(s.http["oldlogit-1"], token=s.token) as c:
            vocab = c.info().vocab_size
            self.acked = {v.policy_version: v.weight_sha256 for v in c.versions()}
            res = c.publish(1, new_weights(self.model_dir, 1))  # HTTP upload to replica 1
            check(res.created, f"version 1 not created: {res}")
            self.acked[1] = res.weight_sha256
        with Client(s.grpc["oldlogit-2"], token=s.token) as c:  # gRPC stream to replica 2
            res = c.publish(2, new_weights(self.model_dir, 2))
            self.acked[2] = res.weight_sha256
        self.seqs = sequences(4, 48, vocab)
        for version, origin, other in (
            (1, "oldlogit-1", "oldlogit-2"),
            (2, "oldlogit-2", "oldlogit-1"),
        ):
            ref = answers(s.grpc[origin], s.token, self.seqs, version)
            for url in (s.grpc[other], s.http[other], s.http[origin]):
                check(
                    same_bits(ref, answers(url, s.token, self.seqs, version)),
                    f"{url} differs from {origin} for version {version}",
                )
            self.reference[version] = ref
        with Client(s.http["oldlogit-2"], token=s.token) as c:
            seen = {v.policy_version: v.weight_sha256 for v in c.versions()}
        check(all(seen.get(v) == h for v, h in self.acked.items()), f"{seen} != {self.acked}")
        return (
            f"v1 published over HTTP on oldlogit-1, v2 over gRPC on oldlogit-2; "
            f"{len(self.seqs)} sequences x 2 versions bitwise equal on both replicas over "
            f"gRPC and HTTP (result cache bypassed)"
        )

    def auth(self) -> str:
        from oldlogit import Client
        from oldlogit.contract import errors

        s = self.stack
        refused = 0
        for url in (s.http["oldlogit-1"], s.grpc["oldlogit-2"]):
            for token in (None, "not-the-token"):
                with Client(url, token=token, retries=0) as c:
                    for write in (
                        lambda c=c: c.publish(99, new_weights(self.model_dir, 99)),
                        lambda c=c: c.set_watermark(1),
                    ):
                        try:
                            write()
                        except errors.Unauthorized:
                            refused += 1
                        else:
                            raise StepFailed(f"a write with token={token!r} on {url} passed")
        with Client(s.http["oldlogit-1"]) as c:  # reads need no token here
            check(99 not in {v.policy_version for v in c.versions()}, "version 99 appeared")
        return f"{refused}/8 writes without / with a wrong token refused (401 / UNAUTHENTICATED)"

    def discover(self) -> str:
        """From a container on the project's network: discover() must list addresses that
        work there (each replica's service name), and every one must answer."""
        networks = list(self.stack.inspect("oldlogit-1")["NetworkSettings"]["Networks"])
        check(len(networks) == 1, f"networks: {networks}")
        script = (
            "import json, sys\n"
            "from oldlogit import Client\n"
            "out = {}\n"
            "for url in ('grpc://oldlogit-1:50051', 'http://oldlogit-2:8000'):\n"
            "    with Client(url) as c:\n"
            "        found = sorted(c.discover())\n"
            "    for u in found:\n"
            "        with Client(u) as c:\n"
            "            r = c.logprobs([1, 2, 3, 4, 5], policy_version=2, use_cache=False)\n"
            "            assert r.exact and r.versions == [2], r\n"
            "    out[url] = found\n"
            "print(json.dumps(out))\n"
        )
        argv = [
            "docker",
            "run",
            "--rm",
            "--network",
            networks[0],
            "--read-only",
            "--entrypoint",
            "python",
            self.image,
            "-c",
            script,
        ]
        found = json.loads(sh(argv, timeout=180).strip().splitlines()[-1])
        want = {
            "grpc://oldlogit-1:50051": ["grpc://oldlogit-1:50051", "grpc://oldlogit-2:50051"],
            "http://oldlogit-2:8000": ["http://oldlogit-1:8000", "http://oldlogit-2:8000"],
        }
        check(found == want, f"discover() inside the network: {found}")
        return f"discover() inside {networks[0]}: {found['grpc://oldlogit-1:50051']} (and HTTP)"

    def demo(self) -> str:
        from oldlogit import Client

        s = self.stack
        with Client(s.http["oldlogit-2"]) as c:
            before = max(v.policy_version for v in c.versions())
        s.run("up", "-d", "--no-build", *DEMO, profile=True, timeout=300)
        s.wait_healthy(DEMO, timeout_s=300)

        def progress() -> tuple[int, int]:
            with Client(s.http["oldlogit-2"]) as c:
                newest = max(v.policy_version for v in c.versions())
            rounds = s.logs("rollout-worker", tail=1000).count("mean logprob")
            return newest - before, rounds

        wait_for(
            "2 trainer versions and 2 rollout rounds", lambda: min(progress()) >= 2, 180, every_s=3
        )
        published, rounds = progress()
        s.run("stop", "-t", "5", *DEMO, profile=True)
        with Client(s.http["oldlogit-1"]) as c:
            self.acked = {v.policy_version: v.weight_sha256 for v in c.versions()}
        return f"trainer published {published} versions, rollout worker answered {rounds} rounds"

    def served(self, name: str) -> float:
        """Requests replica ``name`` has answered (its Prometheus ``oldlogit_requests``)."""
        text = httpx.get(f"{self.stack.http[name]}/metrics", timeout=10).text
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("oldlogit_requests_total")
        )

    def failover(self) -> str:
        from oldlogit import Client

        s = self.stack
        # Every acknowledged version under load, so both replicas are first choice for some.
        for v in self.acked:
            if v not in self.reference:
                self.reference[v] = answers(s.grpc["oldlogit-2"], s.token, self.seqs, v)
        ok, failed, errors_seen = [0], [0], []
        stop = threading.Event()
        versions = sorted(self.reference)

        def load(urls: list[str]) -> None:
            with Client(urls, token=s.token, timeout_s=30) as c:
                i = 0
                while not stop.is_set() and ok[0] + failed[0] < 50_000:
                    v = versions[i % len(versions)]
                    ids = self.seqs[i % len(self.seqs)]
                    i += 1
                    try:
                        r = c.logprobs(ids, policy_version=v, score_from=4, temperature=0.7)
                        want = self.reference[v][self.seqs.index(ids)]
                        if not same_bits([np.asarray(r.logprobs, np.float32)], [want]):
                            raise StepFailed(f"a different answer for version {v}")
                        ok[0] += 1
                    except Exception as exc:
                        failed[0] += 1
                        errors_seen.append(repr(exc)[:300])

        clients = [
            [s.grpc["oldlogit-1"], s.grpc["oldlogit-2"]],
            [s.grpc["oldlogit-2"], s.grpc["oldlogit-1"]],
            [s.http["oldlogit-1"], s.http["oldlogit-2"]],
        ]
        threads = [threading.Thread(target=load, args=(u,), daemon=True) for u in clients]
        before = {n: self.served(n) for n in REPLICAS}
        for t in threads:
            t.start()
        time.sleep(5)
        # The victim is the replica that was answering more of the load.
        during = {n: self.served(n) - before[n] for n in REPLICAS}
        self.victim = max(REPLICAS, key=lambda n: during[n])
        check(during[self.victim] > 0, f"no replica answered the load: {during}")
        before_kill = ok[0]
        sh(["docker", "kill", s.container(self.victim)])
        time.sleep(10)
        stop.set()
        for t in threads:
            t.join(timeout=60)
        check(failed[0] == 0, f"{failed[0]} failed requests: {errors_seen[:3]}")
        check(ok[0] > before_kill > 0, f"no progress: {before_kill} then {ok[0]}")
        return (
            f"docker kill {self.victim} (it had answered {during[self.victim]:.0f} of "
            f"{sum(during.values()):.0f} requests) under 3 clients (2 gRPC, 1 HTTP), "
            f"{len(versions)} versions: {ok[0]} requests ({ok[0] - before_kill} after the "
            f"kill), 0 failed, all bitwise as before"
        )

    def restart(self) -> str:
        from oldlogit import Client

        s = self.stack

        def all_back(where: str) -> None:
            for name in REPLICAS:
                with Client(s.http[name], token=s.token) as c:
                    seen = {v.policy_version: v.weight_sha256 for v in c.versions()}
                check(
                    all(seen.get(v) == h for v, h in self.acked.items()),
                    f"{where}: {name} lists {seen}, acknowledged {self.acked}",
                )
                for v, ref in self.reference.items():
                    check(
                        same_bits(ref, answers(s.grpc[name], s.token, self.seqs, v)),
                        f"{where}: {name} answers version {v} differently",
                    )

        s.run("start", self.victim)
        s.wait_healthy(REPLICAS)
        all_back(f"after restarting {self.victim}")
        # Every container removed and re-created; the named volumes (snapshots, registry) stay.
        # (`rm -v` rather than `down`: it also drops the containers' anonymous volumes.)
        s.run("rm", "-s", "-f", "-v", profile=True)
        s.run("up", "-d", "--no-build", timeout=600)
        s.wait_healthy(REDIS + REPLICAS)
        all_back("after re-creating every container")
        return (
            f"{len(self.acked)} acknowledged versions ({min(self.acked)}..{max(self.acked)}) "
            f"back with their sha256 on both replicas after a replica restart and after "
            f"re-creating every container; answers bitwise as before"
        )

    def hardening(self) -> str:
        s = self.stack
        for name in REPLICAS + REDIS:
            c = s.container(name)
            info = s.inspect(name)
            check(info["HostConfig"]["ReadonlyRootfs"], f"{name}: root file system writable")
            status = sh(["docker", "exec", c, "cat", "/proc/1/status"])
            uid = next(ln.split()[1] for ln in status.splitlines() if ln.startswith("Uid:"))
            check(uid != "0", f"{name}: its process runs as root")
            if name in REPLICAS:
                check(uid == UID and info["Config"]["User"] == UID, f"{name}: uid {uid}")
            probe = subprocess.run(["docker", "exec", c, "touch", "/probe"], capture_output=True)
            check(probe.returncode != 0, f"{name}: wrote to its root file system")
        return f"replicas run as uid {UID}, Redis as a non-root user; every root fs read-only"


# ------------------------------------------------------------------------------ driver


def ensure_images(args: argparse.Namespace, env: dict[str, str]) -> str:
    image = f"oldlogit:{env['OLDLOGIT_TAG']}"
    have = subprocess.run(["docker", "image", "inspect", image], capture_output=True)
    if args.reuse_image and have.returncode == 0:
        note = "reused"
    else:
        subprocess.run(
            [str(REPO / "scripts" / "build_image.sh")],
            check=True,
            timeout=1800,
            env={**os.environ, "IMAGE": image, "DOCKER_BUILD_FLAGS": "-q"},
        )
        note = "built"
    redis = REDIS_IMAGE
    if subprocess.run(["docker", "image", "inspect", redis], capture_output=True).returncode:
        pulled = subprocess.run(
            ["timeout", "120", "docker", "pull", "-q", redis], capture_output=True
        )
        if pulled.returncode != 0:
            print(f"   {redis} cannot be pulled here: using {LOCAL_REDIS_IMAGE}", flush=True)
            subprocess.run([str(REPO / "scripts" / "make_base_images.sh")], check=True, timeout=900)
            redis = LOCAL_REDIS_IMAGE
    env["OLDLOGIT_REDIS_IMAGE"] = redis
    size = int(sh(["docker", "image", "inspect", "-f", "{{.Size}}", image]).strip())
    return f"{image} {note} ({size // 1_000_000} MB), Redis {redis}"


@contextmanager
def terminated_cleanly() -> Iterator[None]:
    """SIGTERM (a CI time-out) unwinds like Ctrl-C, so the stack is still torn down."""

    def raise_interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, raise_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reuse-image", action="store_true", help="use oldlogit:TAG if it exists")
    ap.add_argument("--tag", default="latest", help="image tag (OLDLOGIT_TAG), default latest")
    ap.add_argument("--keep", action="store_true", help="leave the stack up (debugging)")
    args = ap.parse_args(argv)

    start = time.monotonic()
    compose = compose_command()
    version = sh([*compose, "version", "--short"], check_rc=False).strip() or "?"
    workdir = Path(tempfile.mkdtemp(prefix="oldlogit-compose-test-"))
    project = f"oldlogit-ct-{secrets.token_hex(3)}"
    env = {
        **os.environ,
        "OLDLOGIT_TAG": args.tag,
        "OLDLOGIT_WRITE_TOKEN": secrets.token_hex(16),
        "OLDLOGIT_REDIS_PASSWORD": secrets.token_hex(16),
        "OLDLOGIT_PUBLISH_ADDR": "127.0.0.1",
        **{f"OLDLOGIT_{i}_{k}_PORT": str(free_port()) for i in (1, 2) for k in ("HTTP", "GRPC")},
    }
    print(f"compose-test: project {project}, {' '.join(compose)} {version}", flush=True)
    steps: list[tuple[str, Callable[[], str]]] = []
    run: Run | None = None
    stack = Stack(compose, env, project)
    passed = 0
    failed: str | None = None

    def images() -> str:
        nonlocal run
        note = ensure_images(args, env)
        env["OLDLOGIT_MODEL_DIR"] = str(tiny_model(workdir))
        run = Run(stack, Path(env["OLDLOGIT_MODEL_DIR"]), f"oldlogit:{args.tag}")
        return note

    def step(fn: Callable[[Run], str]) -> Callable[[], str]:
        return lambda: fn(run) if run is not None else "not run"

    steps = [
        ("images: build or reuse oldlogit, find or build Redis", images),
        ("up: both Redis and both replicas healthy", step(Run.up)),
        (
            "publish with the write token on one replica, bitwise-equal answers on the other "
            "over gRPC and HTTP",
            step(Run.publish_and_read),
        ),
        ("writes without the token refused", step(Run.auth)),
        ("discover() from a container inside the compose network", step(Run.discover)),
        ("demo profile: the trainer and the rollout worker make progress", step(Run.demo)),
        ("docker kill one replica under client load: zero failed requests", step(Run.failover)),
        ("restart: every acknowledged version back", step(Run.restart)),
        ("non-root, read-only root file systems", step(Run.hardening)),
    ]
    total = len(steps) + 1  # + tear down
    with terminated_cleanly():
        try:
            for i, (name, fn) in enumerate(steps, 1):
                t0 = time.monotonic()
                print(f"== [{i}/{total}] {name}", flush=True)
                try:
                    detail = fn()
                except Exception as exc:  # any error fails the step, then the stack goes down
                    failed = f"{name}: {exc!r}"
                    print(f"   FAIL ({time.monotonic() - t0:.1f} s): {exc}", flush=True)
                    print(stack.logs(tail=30), flush=True)
                    break
                passed += 1
                print(f"   ok ({time.monotonic() - t0:.1f} s): {detail}", flush=True)
        except KeyboardInterrupt:
            failed = "interrupted"
        finally:
            t0 = time.monotonic()
            print(f"== [{total}/{total}] tear down: containers, networks, volumes", flush=True)
            if args.keep:
                print(f"   kept: {' '.join(stack.compose)} --profile demo down -v", flush=True)
            else:
                try:
                    stack.down()
                    if failed is None:
                        passed += 1
                    print(
                        f"   ok ({time.monotonic() - t0:.1f} s): no container or volume left",
                        flush=True,
                    )
                except Exception as exc:
                    failed = failed or f"tear down: {exc!r}"
                    print(f"   FAIL: {exc}", flush=True)
            shutil.rmtree(workdir, ignore_errors=True)
    elapsed = time.monotonic() - start
    verdict = "PASS" if failed is None else "FAIL"
    print(
        f"compose-test: {verdict}, {passed}/{total} steps passed in {elapsed:.0f} s "
        f"({' '.join(compose)} {version})" + (f": {failed}" if failed else "")
    )
    return 0 if failed is None else 1


if __name__ == "__main__":
    sys.exit(main())
