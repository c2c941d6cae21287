"""The ``oldlogit`` command: ``serve``, ``publish``, ``bench``, ``parity``.

Every ``serve`` flag is also an ``OLDLOGIT_*`` environment variable (flags win); the flags
given are the only ones passed to ``Settings``, which reads the environment for the rest.
Logging is configured here and nowhere else.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_SERVE_FLAGS: list[tuple[str, dict[str, Any]]] = [
    ("--model", {"type": Path, "metavar": "DIR", "help": "HF-format model directory"}),
    (
        "--demo",
        {
            "action": "store_true",
            "default": None,
            "help": "tiny random causal LM with a few versions: no model, no network",
        },
    ),
    ("--snapshot-dir", {"type": Path, "metavar": "DIR", "help": "where versions are kept"}),
    ("--host", {"help": "address to bind (default 127.0.0.1)"}),
    ("--http-port", {"type": int, "help": "HTTP port (default 8000; 0 picks a free one)"}),
    ("--grpc-port", {"type": int, "help": "gRPC port (default 50051; 0 picks a free one)"}),
    (
        "--advertise-host",
        {
            "help": "the host other machines reach this replica at, listed in /v1/replicas "
            "(default: --host if it is a specific address, else this machine's hostname)"
        },
    ),
    ("--device", {"choices": ["auto", "cpu", "cuda"]}),
    ("--dtype", {"choices": ["bfloat16", "float16", "float32"]}),
    (
        "--lm-head-fp32",
        {
            "action": "store_true",
            "default": None,
            "help": "cast hidden states and head weight to float32 for the head",
        },
    ),
    ("--mode", {"choices": ["deterministic", "fast"]}),
    (
        "--numerics",
        {
            "choices": ["invariant", "hf"],
            "help": "invariant (default): the batch-invariant forward trainers get from "
            "oldlogit.parity; hf: the unpatched transformers forward of each sequence alone",
        },
    ),
    ("--tile-rows", {"type": int, "help": "rows per GEMM tile of the invariant numerics (64)"}),
    (
        "--tp-chunks",
        {
            "type": int,
            "help": "the tensor-parallel definition: row-parallel sums and the head's "
            "log-softmax in N float32 chunks, the same bits at any tensor-parallel degree "
            "dividing N (8 matches trainers under trainer_numerics(tp_chunks=8); 0: off)",
        },
    ),
    (
        "--tensor-parallel",
        {
            "type": int,
            "metavar": "N",
            "help": "one replica over N ranks (gloo on CPU, NCCL on CUDA: one GPU each), each "
            "holding 1/N of every version; this process serves HTTP/gRPC and starts the "
            "others; bitwise equal to 1 at the same --tp-chunks (8 unless given)",
        },
    ),
    (
        "--rank-timeout-s",
        {
            "type": float,
            "help": "how long a tensor-parallel rank may take to join, and the longest a "
            "collective waits (120)",
        },
    ),
    (
        "--device-budget-gib",
        {
            "type": float,
            "help": "weights on the device (default: free GPU memory minus "
            "--activation-headroom-gib; 4 on CPU)",
        },
    ),
    ("--activation-headroom-gib", {"type": float, "help": "GPU memory left to the forward (2)"}),
    ("--host-budget-gib", {"type": float}),
    ("--disk-budget-gib", {"type": float}),
    ("--max-versions", {"type": int}),
    (
        "--keyframe-every",
        {"type": int, "help": "a keyframe at least every N versions, patches between (1: none)"},
    ),
    (
        "--keyframe-chain-fraction",
        {"type": float, "help": "a keyframe once a chain's patches exceed this x a keyframe"},
    ),
    (
        "--fixed-keyframes",
        {
            "action": "store_false",
            "default": None,
            "dest": "keyframes_follow_access",
            "help": "keyframes stay where they were stored (default: the sweeper moves one "
            "down its chain to where rebuilds are asked for)",
        },
    ),
    (
        "--strategy",
        {
            "choices": ["snapshot", "lagging"],
            "help": "snapshot: random access; lagging: one model advanced in version order",
        },
    ),
    ("--redis-url", {"help": "Redis for registry/leases/membership (scale-out)"}),
    ("--cache-redis-url", {"help": "Redis for the shared result cache"}),
    ("--namespace", {"help": "deployment namespace for Redis keys (default 'default')"}),
    ("--replica-id", {"help": "this replica's id in the deployment (default host-pid)"}),
    ("--write-token", {"help": "bearer token required for writes (publish, delete, leases)"}),
    ("--read-token", {"help": "bearer token required for reads"}),
    (
        "--tls-cert-file",
        {
            "type": Path,
            "metavar": "PEM",
            "help": "serve HTTPS and gRPC over TLS with this certificate chain (re-read on "
            "SIGHUP and when it changes)",
        },
    ),
    ("--tls-key-file", {"type": Path, "metavar": "PEM", "help": "the chain's private key"}),
    (
        "--tls-client-ca-file",
        {
            "type": Path,
            "metavar": "PEM",
            "help": "mutual TLS: require a client certificate signed by this CA",
        },
    ),
    (
        "--tls-reload-interval-s",
        {"type": float, "help": "how often the TLS files are checked for changes (30)"},
    ),
    (
        "--health-port",
        {
            "type": int,
            "help": "also serve /healthz and /readyz, and nothing else, as plain HTTP on this "
            "port (probes that cannot speak TLS; default: none)",
        },
    ),
    (
        "--max-wait-ms",
        {
            "type": float,
            "help": "batching wait for the first job in a batch (none for a lone job after a "
            "batch of one)",
        },
    ),
    ("--max-batch-tokens", {"type": int}),
    ("--max-queue", {"type": int}),
    ("--max-seq-len", {"type": int}),
    ("--cache-budget-mib", {"type": float}),
    (
        "--publish-root",
        {
            "type": Path,
            "action": "append",
            "dest": "publish_roots",
            "metavar": "DIR",
            "help": "allow publish-by-path under DIR (repeatable)",
        },
    ),
    ("--drain-timeout-s", {"type": float}),
    ("--sweep-interval-s", {"type": float, "help": "lease expiry and retention period (1)"}),
    (
        "--ewma-beta",
        {
            "type": float,
            "metavar": "BETA",
            "help": "serve the approximate EWMA proxy policy (proxy='ewma', and allow_inexact "
            "when a version is gone) with this decay in (0, 1); off by default",
        },
    ),
    ("--log-level", {"help": "DEBUG, INFO, WARNING, ERROR"}),
]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="oldlogit", description="The old-logit service.")
    sub = p.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the HTTP and gRPC servers")
    for flag, kw in _SERVE_FLAGS:
        serve.add_argument(flag, **kw)
    pub = sub.add_parser("publish", help="publish weights to a running service")
    pub.add_argument("--url", required=True, help="http://HOST:PORT or grpc://HOST:PORT")
    pub.add_argument("--version", type=int, required=True, dest="policy_version")
    src = pub.add_mutually_exclusive_group(required=True)
    src.add_argument("--weights", type=Path, help="safetensors file or directory to upload")
    src.add_argument("--path", type=Path, help="file or directory the service reads itself")
    src.add_argument(
        "--adapter",
        type=Path,
        help="a PEFT LoRA adapter's save_pretrained directory, published as an adapter version "
        "over --base-version",
    )
    pub.add_argument(
        "--base-version",
        type=int,
        default=None,
        dest="base_version",
        help="the full-weights version an --adapter applies to",
    )
    pub.add_argument(
        "--delta",
        action="store_true",
        help="diff against the last weights this client published (a one-shot command has "
        "none: it sends everything, and the service stores a patch anyway)",
    )
    pub.add_argument(
        "--cast",
        action="store_true",
        help="cast floating tensors (e.g. a float32 checkpoint) to the serving dtype",
    )
    pub.add_argument("--token", default=None, help="write token (or OLDLOGIT_WRITE_TOKEN)")
    _tls_flags(pub)
    pub.add_argument("--no-progress", action="store_true")
    bench = sub.add_parser("bench", help="run the benchmark suite")
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="arguments for the suite")
    par = sub.add_parser(
        "parity",
        help="how far a trainer's forward (plain, or under oldlogit.parity) is from the service",
    )
    par.add_argument("--url", required=True, help="http://HOST:PORT or grpc://HOST:PORT")
    par.add_argument(
        "--model",
        type=Path,
        required=True,
        metavar="DIR",
        help="HF-format directory holding the weights of --version (the trainer's model)",
    )
    par.add_argument("--version", type=int, default=0, dest="policy_version")
    par.add_argument("--samples", type=int, default=32, help="random sequences to score")
    par.add_argument("--prompt-len", type=int, default=32, help="longest prompt (tokens)")
    par.add_argument("--completion-len", type=int, default=64, help="longest completion")
    par.add_argument("--micro-batches", default="1,4,8", help="micro-batch sizes, e.g. 1,4,8")
    par.add_argument("--padding", choices=["left", "right"], default="left")
    par.add_argument("--forward", choices=["plain", "patched", "both"], default="both")
    par.add_argument("--temperature", type=float, default=1.0)
    par.add_argument("--top-k", type=int, default=0)
    par.add_argument("--top-p", type=float, default=1.0)
    par.add_argument("--seed", type=int, default=0)
    par.add_argument(
        "--explain",
        action="store_true",
        help="also run the parity canary (oldlogit.parity.verify) on the model under the "
        "service's numerics: bitwise, or where the two forwards first diverge (exit 1)",
    )
    par.add_argument("--token", default=None, help="read token (or OLDLOGIT_READ_TOKEN)")
    _tls_flags(par)
    return p


def _tls_flags(p: argparse.ArgumentParser) -> None:
    """The client's TLS options (https:// and grpcs:// URLs), as for ``Client``."""
    p.add_argument("--ca-file", metavar="PEM", help="trust this CA (default: the system's)")
    p.add_argument("--cert-file", metavar="PEM", help="client certificate (mutual TLS)")
    p.add_argument("--key-file", metavar="PEM", help="the client certificate's private key")


def _tls_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {"ca_file": args.ca_file, "cert_file": args.cert_file, "key_file": args.key_file}


def _serve(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from oldlogit_service.config import Settings

    given = {k: v for k, v in vars(args).items() if k != "command" and v is not None}
    try:
        settings = Settings(**given)
    except ValidationError as exc:
        for err in exc.errors():
            loc = ".".join(str(x) for x in err["loc"])
            where = f"--{loc.replace('_', '-')}: " if loc else ""
            print(f"oldlogit serve: {where}{err['msg']}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from oldlogit_service.api.tls import TlsConfigError
    from oldlogit_service.model.allocator import tune_allocator
    from oldlogit_service.server import Bound, serve, server_tls

    tune_allocator()  # before any serving thread starts (model/allocator.py)

    try:
        tls = server_tls(settings)  # before the model loads: a bad file fails at once
    except TlsConfigError as exc:
        print(f"oldlogit serve: {exc}", file=sys.stderr)
        return 2

    def ready(bound: Bound, _rt: Any) -> None:
        # One line each, machine-readable: scripts and tests read the chosen ports from here.
        # The probe port first: whoever waits for http= and grpc= has it already.
        if bound.health is not None:
            print(f"health={bound.health}", flush=True)
        print(f"http={bound.http}", flush=True)
        print(f"grpc={bound.grpc}", flush=True)
        if settings.write_token is None:
            logging.getLogger("oldlogit").warning(
                "no --write-token: publish/delete/watermark/leases refused"
                + (" (TLS is on)" if tls is not None else " except from loopback")
            )

    from oldlogit import OldLogitError
    from oldlogit.parity.tensor_parallel import TensorParallelError
    from oldlogit_service.model.engine import NumericsCheckFailed
    from oldlogit_service.model.loaded import UnsupportedModel
    from oldlogit_service.ranks.launch import RankJoinError

    started = False

    def on_ready(bound: Bound, rt: Any) -> None:
        nonlocal started
        started = True
        ready(bound, rt)

    try:
        asyncio.run(serve(settings, on_ready=on_ready, tls=tls))
    except NumericsCheckFailed as exc:
        print(f"oldlogit serve: {exc}; start with --numerics hf to serve anyway", file=sys.stderr)
        return 2
    except UnsupportedModel as exc:  # one line naming the architecture, no traceback
        print(f"oldlogit serve: {exc}", file=sys.stderr)
        return 2
    except (RankJoinError, TensorParallelError) as exc:  # names the rank or the setting
        print(f"oldlogit serve: {exc}", file=sys.stderr)
        return 2
    except OldLogitError as exc:
        if started:
            raise
        # e.g. the model directory's weights do not fit its config (names the tensor)
        print(f"oldlogit serve: {exc.code}: {exc.message}", file=sys.stderr)
        return 2
    return 0


def _publish(args: argparse.Namespace) -> int:
    import os

    from oldlogit import Client, OldLogitError

    token = args.token or os.environ.get("OLDLOGIT_WRITE_TOKEN")
    if (args.adapter is None) != (args.base_version is None):
        print("oldlogit publish: --adapter and --base-version go together", file=sys.stderr)
        return 2
    try:
        with Client(args.url, token=token, timeout_s=3600.0, **_tls_kwargs(args)) as c:
            if args.adapter is not None:
                res = c.publish_adapter(
                    args.policy_version,
                    args.adapter,
                    base_version=args.base_version,
                    progress=not args.no_progress,
                )
            elif args.path is not None:
                res = c.publish(args.policy_version, str(args.path), by_path=True)
            else:
                res = c.publish(
                    args.policy_version,
                    args.weights,
                    delta=args.delta,
                    progress=not args.no_progress,
                    cast=args.cast,
                )
    except OldLogitError as exc:
        where = f" ({exc.parameter})" if exc.parameter else ""
        print(f"oldlogit publish: {exc.code}{where}: {exc.message}", file=sys.stderr)
        return 1
    state = "published" if res.created else "already published (same weights)"
    print(f"version {res.policy_version} {state}: sha256={res.weight_sha256}")
    return 0


def _parity(args: argparse.Namespace) -> int:
    import os

    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from oldlogit import Client, OldLogitError
    from oldlogit.parity import InvariantNumericsError, NumericsMismatch, ParityBroken, compare
    from oldlogit.parity import verify as parity_verify

    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # stderr: errors only
    token = args.token or os.environ.get("OLDLOGIT_READ_TOKEN")
    try:
        sizes = [int(x) for x in str(args.micro_batches).split(",") if x.strip()]
        if not sizes or min(sizes) < 1 or args.samples < 1:
            raise ValueError("--micro-batches and --samples must be positive")
        with Client(args.url, token=token, timeout_s=600.0, **_tls_kwargs(args)) as c:
            info = c.info()
            model: Any = AutoModelForCausalLM.from_pretrained(
                str(args.model), dtype=getattr(torch, info.dtype)
            )
            model = model.to(info.device.split(":")[0]).eval()
            rng = np.random.default_rng(args.seed)
            samples = []
            for _ in range(args.samples):
                p = int(rng.integers(max(1, args.prompt_len // 2), args.prompt_len + 1))
                n = p + int(rng.integers(max(1, args.completion_len // 2), args.completion_len + 1))
                samples.append((rng.integers(0, info.vocab_size, n), p))
            forwards = ("plain", "patched") if args.forward == "both" else (args.forward,)
            report = compare(
                model,
                c,
                samples,
                policy_version=args.policy_version,
                micro_batch_sizes=sizes,
                padding_side=args.padding,
                forwards=forwards,
                temperature=args.temperature,
                top_k=args.top_k,
                top_p=args.top_p,
            )
            print(report.table())
            if args.explain:
                try:
                    canary = parity_verify(
                        model,
                        c,
                        args.policy_version,
                        temperature=args.temperature,
                        top_k=args.top_k,
                        top_p=args.top_p,
                    )
                except ParityBroken as exc:
                    print(f"canary: {exc}")
                    return 1
                print(
                    f"canary: {canary.tokens} tokens of {canary.sequences} sequences bitwise "
                    f"equal at version {canary.policy_version} under the service's numerics"
                )
    except OldLogitError as exc:
        where = f" ({exc.parameter})" if exc.parameter else ""
        print(f"oldlogit parity: {exc.code}{where}: {exc.message}", file=sys.stderr)
        return 1
    except (NumericsMismatch, InvariantNumericsError, ValueError, OSError) as exc:
        print(f"oldlogit parity: {exc}", file=sys.stderr)
        return 1
    return 0


def _bench(args: argparse.Namespace) -> int:
    import importlib

    # The suite lives in the source checkout's benchmarks/ (not in the wheel): find it from
    # the working directory or from an editable install's tree.
    for root in (Path.cwd(), Path(__file__).resolve().parents[2]):
        if (root / "benchmarks" / "suite.py").is_file():
            sys.path.insert(0, str(root))
            break
    try:
        bench_main = importlib.import_module("benchmarks.suite").main
    except ImportError:
        print(
            "oldlogit bench: run it from a source checkout (the benchmarks/ folder)",
            file=sys.stderr,
        )
        return 2
    return int(bench_main(list(args.rest)))


def main(argv: Sequence[str] | None = None) -> int:
    import os

    # gRPC's core logs every failed TLS handshake at INFO on stderr; the commands report
    # errors in one line of their own (GRPC_VERBOSITY set by the user still wins).
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:  # the suite parses its own flags
        return _bench(argparse.Namespace(rest=argv[1:]))
    args = _parser().parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    if args.command == "publish":
        return _publish(args)
    if args.command == "parity":
        return _parity(args)
    return _bench(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
