"""The CLI: `serve --demo` on port 0, env vars, graceful SIGTERM, restart, `publish`, `parity`,
and the start-ups `serve` refuses in one line. Env vars with a restart, and SIGTERM, run under
the ``slow`` marker (two and one server starts of their own, ~20 and ~12 s on 2 cores); the
default run reads settings from ``OLDLOGIT_*`` variables (tests/unit/test_advertise_host.py),
drains in-process (tests/integration/test_ops.py) and reopens versions from the snapshot
directory (tests/unit/test_store.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from oldlogit import Client

from .conftest import REPO, CliServer, start_cli

pytestmark = pytest.mark.e2e


def _started(*argvs: list[str], env: dict[str, str] | None = None) -> list[subprocess.Popen[str]]:
    """Commands started at once (output captured), to run side by side."""
    return [
        subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env=env,
        )
        for argv in argvs
    ]


def _finished(proc: subprocess.Popen[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """``proc`` waited for (killed past ``timeout``), as ``subprocess.run`` returns it."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_demo_serves_versions_over_both_transports(demo_server: CliServer) -> None:
    for url in (f"http://{demo_server.http}", f"grpc://{demo_server.grpc}"):
        with Client(url) as c:
            assert [v.policy_version for v in c.versions()] == [0, 1, 2, 3]
            r = c.logprobs(list(range(1, 30)), policy_version=3, score_from=5)
            assert np.isnan(r.logprobs[:5]).all() and np.isfinite(r.logprobs[5:]).all()
    h = httpx.get(f"http://{demo_server.http}/healthz")
    assert h.status_code == 200
    m = httpx.get(f"http://{demo_server.http}/metrics").text
    assert "oldlogit_requests_total" in m and "oldlogit_tier_bytes" in m
    assert httpx.get(f"http://{demo_server.http}/docs").status_code == 200
    page = httpx.get(f"http://{demo_server.http}/").text
    assert '<table id="versions">' in page


def test_bad_flag_is_a_sentence_not_a_traceback() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "oldlogit_service.cli", "serve"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert out.returncode == 2
    assert "--model" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.slow  # two `oldlogit serve` starts of its own: ~20 s on 2 cores
def test_env_vars_and_restart_keep_versions(tmp_path: Path) -> None:
    snap = tmp_path / "snap"
    env = {
        "OLDLOGIT_DEMO": "true",
        "OLDLOGIT_SNAPSHOT_DIR": str(snap),
        "OLDLOGIT_HTTP_PORT": "0",
        "OLDLOGIT_GRPC_PORT": "0",
        "OLDLOGIT_DTYPE": "float32",
    }
    srv = start_cli([], env=env)
    try:
        with Client(f"http://{srv.http}") as c:
            info = c.info()
            assert info.dtype == "float32"
            before = {v.policy_version: v.weight_sha256 for v in c.versions()}
            r1 = c.logprobs(list(range(40)), policy_version=2).logprobs
    finally:
        assert srv.stop() == 0
    srv = start_cli([], env=env)
    try:
        with Client(f"grpc://{srv.grpc}") as c:
            after = {v.policy_version: v.weight_sha256 for v in c.versions()}
            r2 = c.logprobs(list(range(40)), policy_version=2).logprobs
    finally:
        srv.stop()
    assert after == before
    assert np.array_equal(r1, r2, equal_nan=True)


@pytest.mark.slow  # an `oldlogit serve` start of its own: ~12 s on 2 cores
def test_sigterm_drains_in_flight_requests(tmp_path: Path) -> None:
    srv = start_cli(
        [
            "--demo",
            "--http-port",
            "0",
            "--grpc-port",
            "0",
            "--snapshot-dir",
            str(tmp_path / "s"),
            "--max-wait-ms",
            "20",
        ]
    )
    results: list[object] = []

    def hammer() -> None:
        with Client(f"grpc://{srv.grpc}", retries=0) as c:
            try:
                results.append(c.logprobs(list(range(1, 1500)), policy_version=1, use_cache=False))
            except Exception as exc:
                results.append(exc)

    threads = [threading.Thread(target=hammer) for _ in range(4)]
    for t in threads:
        t.start()
    import time

    time.sleep(0.5)
    rc = srv.stop(signal.SIGTERM)
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive(), "a worker thread did not finish in time"
    assert rc == 0
    # Requests accepted before SIGTERM finish; later ones are refused cleanly (never cut off).
    assert results, "the requests returned"
    for r in results:
        if isinstance(r, Exception):
            from oldlogit import OldLogitError

            assert isinstance(r, OldLogitError), repr(r)


def test_publish_command(demo_server: CliServer, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    from oldlogit_service.demo.deployment import DEMO_MODEL_KWARGS
    from oldlogit_service.demo.tiny import make_tiny_model_dir
    from oldlogit_service.model.checkpoints import load_weights
    from oldlogit_service.model.loaded import load_model

    model_dir = make_tiny_model_dir(tmp_path / "m", **DEMO_MODEL_KWARGS)
    import torch

    model = load_model(model_dir, dtype=torch.bfloat16, device=torch.device("cpu"))
    w = load_weights(model_dir, model)
    assert w is not None
    w = {k: (v.float() * 1.01).to(v.dtype).contiguous() for k, v in w.items()}
    path = tmp_path / "v9.safetensors"
    save_file(w, str(path))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "oldlogit_service.cli",
            "publish",
            "--url",
            f"http://{demo_server.http}",
            "--version",
            "9",
            "--weights",
            str(path),
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "version 9 published" in out.stdout
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "oldlogit_service.cli",
            "publish",
            "--url",
            f"grpc://{demo_server.grpc}",
            "--version",
            "9",
            "--weights",
            str(path),
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert out.returncode == 0 and "already published" in out.stdout


def test_parity_command(demo_server: CliServer, tmp_path: Path) -> None:
    """`oldlogit parity`: the patched forward is bitwise the service at every micro-batch size
    (and ``--explain``'s canary passes); a model holding other weights than the version is
    refused with one line."""
    from oldlogit_service.demo.deployment import DEMO_MODEL_KWARGS
    from oldlogit_service.demo.tiny import make_tiny_model_dir

    model_dir = make_tiny_model_dir(tmp_path / "m", **DEMO_MODEL_KWARGS)  # the demo's version 0
    base = [sys.executable, "-m", "oldlogit_service.cli", "parity", "--model", str(model_dir)]
    args = ["--samples", "6", "--prompt-len", "12", "--completion-len", "20"]
    # The two runs are independent: started together, each its own interpreter (torch and
    # transformers to import), they take one run's time on 2 cores, not two.
    runs = _started(
        [
            *base,
            "--url",
            f"grpc://{demo_server.grpc}",
            "--version",
            "0",
            *args,
            "--micro-batches",
            "1,3",
            "--temperature",
            "0.7",
            "--explain",
        ],
        [*base, "--url", f"http://{demo_server.http}", "--version", "2", *args],
    )
    out, wrong = (_finished(p, timeout=300) for p in runs)
    assert out.returncode == 0, out.stderr
    # --explain: the parity canary on the loaded model under the service's numerics.
    assert "canary: " in out.stdout and "bitwise equal at version 0" in out.stdout, out.stdout
    rows = [
        line.split()
        for line in out.stdout.splitlines()
        if line.split()[:1] in (["plain"], ["patched"])
    ]
    assert [(r[0], r[1]) for r in rows] == [
        ("plain", "1"),
        ("plain", "3"),
        ("patched", "1"),
        ("patched", "3"),
    ]
    for r in rows:
        assert int(r[2]) > 6 * 10  # scored completion tokens
        if r[0] == "patched":
            assert r[3] == "0" and r[4:] == ["0.0", "%"] * 3
    assert wrong.returncode == 1
    assert wrong.stderr.strip().count("\n") == 0 and "weights of version 2" in wrong.stderr


def _refused_serve(snapshot_dir: Path, *args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "oldlogit_service.cli",
        "serve",
        *args,
        "--snapshot-dir",
        str(snapshot_dir),
        "--http-port",
        "0",
        "--grpc-port",
        "0",
        "--log-level",
        "ERROR",
    ]


def _bad_model_dir(path: Path, kind: str) -> Path:
    """A directory oldlogit must refuse at start-up."""
    import json

    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    path.mkdir(parents=True)
    if kind == "not-a-causal-lm":  # transformers builds no causal LM from a T5 config
        cfg = AutoConfig.for_model("t5", d_model=16, d_ff=32, num_layers=1, num_heads=2)
        cfg.save_pretrained(path)
    elif kind == "uncovered-matmul":  # GPT-2's Conv1D multiplies with addmm, not F.linear
        cfg = AutoConfig.for_model("gpt2", n_embd=16, n_layer=1, n_head=2, vocab_size=64)
        cfg.architectures = ["GPT2LMHeadModel"]
        AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    else:  # weights that do not fit the config
        cfg = AutoConfig.for_model(
            "llama",
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            vocab_size=64,
        )
        model = AutoModelForCausalLM.from_config(cfg)
        model.config.save_pretrained(path)
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        state["model.norm.weight"] = torch.zeros(17)
        save_file(state, str(path / "model.safetensors"))
        json.loads((path / "config.json").read_text())
    return path


# The CLI's one-line refusal is the same path for every model it refuses: the default run takes
# it once; the other two (each reason also refused in-process: tests/unit/test_model.py and
# test_parity_invariance.py) are `slow`, ~10 s each on 2 cores.
BAD_MODELS = [
    ("not-a-causal-lm", "cannot serve model_type 't5'"),
    pytest.param("uncovered-matmul", "GPT2LMHeadModel", marks=pytest.mark.slow),
    pytest.param("misfit-weights", "model.norm.weight", marks=pytest.mark.slow),
]
_KINDS = ("not-a-causal-lm", "uncovered-matmul", "misfit-weights")


@pytest.fixture(scope="module")
def refused_starts(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, subprocess.Popen[str]]]:
    """The `serve` start-ups below that must fail (those this run selected), all started before
    the module's first test (``_refusals_first``) and each waited for by its own test: every one
    is an interpreter importing torch and transformers (~10 s on 2 cores), so they take the core
    the tests before them leave idle while they wait on ``demo_server`` and `oldlogit parity`.
    "packing" is the self-check's refusal, the others ``BAD_MODELS``."""
    selected: set[str] = set()
    for item in request.session.items:
        name = getattr(item, "originalname", item.name)
        if item.module is not request.module:
            continue
        if name == "test_serve_refuses_to_start_when_packing_changes_bits":
            selected.add("packing")
        elif name == "test_a_model_that_cannot_be_served_stops_serve_with_one_line":
            selected.add(item.callspec.params["kind"])  # type: ignore[attr-defined]
    tmp = tmp_path_factory.mktemp("refused")
    # The start-up self-check's platform, simulated: the tiles pick up the row count, so a
    # packed batch is not bitwise the sequences alone.
    hook = tmp / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import oldlogit.parity.tiles as t\n"
        "_mm = t.tiled_mm\n"
        "def tiled_mm(x, weight, tile_rows=64, bias=None):\n"
        "    return _mm(x, weight, tile_rows, bias) + x.shape[0] * 1e-3\n"
        "t.tiled_mm = tiled_mm\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{hook}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    procs: dict[str, subprocess.Popen[str]] = {}
    if "packing" in selected:
        procs["packing"] = _started(_refused_serve(tmp / "packing", "--demo"), env=env)[0]
    argvs: dict[str, list[str]] = {}
    for kind in _KINDS:
        if kind in selected:
            model = _bad_model_dir(tmp / kind / "model", kind)
            argvs[kind] = _refused_serve(tmp / kind / "snap", "--model", str(model))
    procs.update(zip(argvs, _started(*argvs.values()), strict=True))
    try:
        yield procs
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.communicate()


@pytest.fixture(scope="module", autouse=True)
def _refusals_first(refused_starts: dict[str, subprocess.Popen[str]]) -> None:
    """``refused_starts`` set up before any other fixture of this module's first test."""


def test_serve_refuses_to_start_when_packing_changes_bits(
    refused_starts: dict[str, subprocess.Popen[str]],
) -> None:
    """The start-up self-check: a platform where a packed batch is not bitwise the sequences
    alone (simulated: the tiles pick up the row count) makes `serve` exit with one line."""
    out = _finished(refused_starts["packing"], timeout=300)
    assert out.returncode == 2
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "packed batch differs" in lines[0] and "--numerics hf" in lines[0]
    assert "Traceback" not in out.stderr and "http=" not in out.stdout


@pytest.mark.parametrize(("kind", "says"), BAD_MODELS)
def test_a_model_that_cannot_be_served_stops_serve_with_one_line(
    refused_starts: dict[str, subprocess.Popen[str]], kind: str, says: str
) -> None:
    out = _finished(refused_starts[kind], timeout=120)
    assert out.returncode == 2, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.startswith("oldlogit serve:")]
    assert len(lines) == 1 and says in lines[0], out.stderr
    assert "Traceback" not in out.stderr
