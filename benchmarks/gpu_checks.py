"""scripts/gpu_checks.sh's steps: one call on a lent GPU machine, one results JSON.

    python -m benchmarks.gpu_checks OUT [--rehearse] [--budget-s S] [--wheels-rc N ...]

Runs each step in its own process group under a time budget, in priority order — the machine,
the `gpu`-marked tests, the CUDA kernels' tests (CUDA_AWARE), invariant-vs-plain,
patched-step-cost, models-vs-hf-forward (the service's start-up self-check included), then the
serving and throughput figures while time remains — and writes OUT/gpu-checks.json after every
step, so a run cut short still leaves what it measured. A step that fails or runs out of time is
recorded (its status, return code and the tail of its output) and the next one runs. OUT also
gets gpu-tests.log/.xml and kernel-tests.log/.xml (pytest's output and junit XML) and steps.log
(every bench step's output). ``--rehearse`` runs the same steps on the CPU at tiny sizes
(``--smoke``; the `gpu` tests are collected and skip, one kernel test runs interpreted): the same
JSON schema (tests/e2e/test_gpu_checks.py).
The JSON is committed as docs/perf/gpu-<card>-<date>.json (docs/performance.md "On a GPU").
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SCHEMA = "oldlogit-gpu-checks/1"
SHAPES = "qwen2.5-1.5b"
TAIL = 4000  # characters of a failed step's output kept in the JSON
# The goals the figures are held to on the GPU (the figures carry them too).
GOALS = {
    "invariant-vs-plain": ">= 0.90",
    "patched-step-cost": "<= 1.10",
    "models-vs-hf-forward": ">= 0.85",
}

MACHINE = r"""
import json, platform, sys
out = {"python": sys.version.split()[0], "platform": platform.platform()}
import torch
out |= {"torch": torch.__version__, "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(), "torch_threads": torch.get_num_threads()}
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    out |= {"device_name": p.name, "capability": list(torch.cuda.get_device_capability(0)),
            "multiprocessors": p.multi_processor_count, "memory_gib": p.total_memory / 2**30,
            "cudnn": torch.backends.cudnn.version()}
import importlib.metadata as md
for name in ("triton", "transformers", "safetensors", "tokenizers", "huggingface-hub", "numpy",
             "pydantic", "fastapi", "uvicorn", "grpcio", "protobuf", "peft", "pytest",
             "pytest-asyncio"):
    try:
        out[name] = md.version(name)
    except md.PackageNotFoundError:
        out[name] = None
import transformers, oldlogit, oldlogit_service
out["transformers_imported"] = transformers.__version__
out["oldlogit_from"] = oldlogit.__file__
print("MACHINE=" + json.dumps(out))
"""


@dataclass
class Step:
    name: str
    budget_s: float  # at most; 0: whatever time is left
    argv: list[str]
    parse: Callable[[Step, str, Path], Any]
    log: str = "steps.log"  # under OUT
    work: Path = field(default_factory=Path)  # a bench's --out; a test step's junit XML
    by_name: bool = False  # runs only when --only names it


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _tail(text: str, n: int = TAIL) -> str:
    return text[-n:]


def _run(
    name: str, argv: list[str], timeout_s: float, log: Path, env: dict[str, str]
) -> tuple[int | None, str]:
    """Run ``argv`` in its own process group, its output appended to ``log`` as it comes (a run
    cut short keeps it); on timeout SIGINT (pytest then writes its report), then SIGKILL to the
    group. Returns (the return code, None on timeout; this run's output)."""
    with log.open("a") as f:
        f.write(f"\n===== {name} {_now()} $ {' '.join(argv)}\n")
        f.flush()
        begin = f.tell()
        proc = subprocess.Popen(
            argv,
            cwd=REPO,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        rc: int | None
        try:
            rc = proc.wait(timeout=timeout_s)
        except KeyboardInterrupt:  # the script's backstop (`timeout --signal=INT`): stop it all
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            raise
        except subprocess.TimeoutExpired:
            rc = None
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        # Whatever the step left running in its group (a bench's server): gone.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    with log.open("rb") as f:
        f.seek(begin)
        text = f.read().decode(errors="replace")
    with log.open("a") as f:
        f.write(f"\n===== {name}: exit {rc}\n")
    return rc, text


def _parse_machine(step: Step, out: str, _: Path) -> dict[str, Any]:
    found = re.search(r"^MACHINE=(.*)$", out, re.M)
    if found is None:
        raise RuntimeError("no MACHINE= line")
    machine: dict[str, Any] = json.loads(found.group(1))
    machine["nvidia_smi"] = _nvidia_smi()
    machine["cpus"] = os.cpu_count()
    machine["host"] = platform.node()
    return machine


def _nvidia_smi(
    query: str = "name,driver_version,memory.total,clocks.max.sm,power.limit",
) -> dict[str, Any] | str:
    try:
        got = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unavailable: {exc}"
    if got.returncode != 0:
        if query.count(",") > 2:  # a field this driver does not know: the basic three
            return _nvidia_smi("name,driver_version,memory.total")
        return f"unavailable: {_tail(got.stdout + got.stderr, 300)}"
    first = got.stdout.strip().splitlines()[0] if got.stdout.strip() else ""
    return dict(zip(query.split(","), (x.strip() for x in first.split(",")), strict=False))


def summarize_tests(xml: Path | None, log_text: str) -> dict[str, Any]:
    """passed/failed/skipped/errors and the failing test ids: from pytest's junit XML when it
    was written, else from the ``-v`` lines of its output (a run cut short)."""
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failing: list[str] = []
    skipped: dict[str, int] = {}
    messages: dict[str, str] = {}  # failing test -> the start of its message
    if xml is not None and xml.is_file():
        try:
            root = ET.parse(xml).getroot()
        except ET.ParseError:
            root = None
        if root is not None:
            times: list[tuple[float, str]] = []
            for case in root.iter("testcase"):
                if not case.get("name"):  # the test a SIGINT stopped: no outcome
                    continue
                cid = f"{case.get('classname', '')}::{case.get('name', '')}"
                times.append((float(case.get("time") or 0), cid))
                kinds = {child.tag: child for child in case}
                bad = kinds.get("failure", kinds.get("error"))
                if bad is not None:
                    counts["failed" if bad.tag == "failure" else "errors"] += 1
                    failing.append(cid)
                    messages[cid] = (bad.get("message") or bad.text or "")[:400]
                elif "skipped" in kinds:
                    counts["skipped"] += 1
                    reason = next(c for c in case if c.tag == "skipped").get("message", "")
                    skipped[reason[:120]] = skipped.get(reason[:120], 0) + 1
                else:
                    counts["passed"] += 1
            slowest = {cid: round(t, 2) for t, cid in sorted(times, reverse=True)[:15]}
            return {
                **counts,
                "failing": failing,
                "messages": messages,
                "skip_reasons": skipped,
                "slowest_s": slowest,
                "source": "junit",
            }
    for m in re.finditer(
        r"^(\S+::\S+(?:\[.*?\])?) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)", log_text, re.M
    ):
        word = m.group(2)
        key = {"PASSED": "passed", "XPASS": "passed", "FAILED": "failed", "ERROR": "errors"}.get(
            word, "skipped"
        )
        counts[key] += 1
        if key in ("failed", "errors"):
            failing.append(m.group(1))
    return {**counts, "failing": failing, "skip_reasons": skipped, "source": "log"}


def interrupted_test(log_text: str) -> str | None:
    """The test a ``-v`` run was in when it stopped (its line has no outcome), if any."""
    last = [line.strip() for line in log_text.splitlines() if "::" in line]
    outcomes = ("PASSED", "FAILED", "SKIPPED", "ERROR", "XFAIL", "XPASS")
    if last and not any(word in last[-1] for word in outcomes) and " " not in last[-1]:
        return last[-1]
    return None


def _parse_tests(step: Step, out: str, outdir: Path) -> dict[str, Any]:
    summary = summarize_tests(step.work, out)
    summary["interrupted_at"] = interrupted_test(out)
    last = [line for line in out.strip().splitlines() if line.startswith("=")]
    summary["last_line"] = last[-1] if last else ""
    return summary


def _parse_bench(step: Step, out: str, _: Path) -> list[dict[str, Any]]:
    results = json.loads((step.work / "results.json").read_text())
    figures: list[dict[str, Any]] = results["figures"]
    for f in figures:
        f["step"] = step.name
    return figures


def _parse_profile(step: Step, out: str, outdir: Path) -> dict[str, Any]:
    """The profile's headline per part (wall, host, GPU-busy ms, launches, syncs); the whole
    of it is OUT/gpu-profile.json."""
    parts = json.loads((outdir / "gpu-profile.json").read_text())["parts"]
    keep = ("wall_ms", "host_ms", "gpu_busy_ms", "launches", "syncs", "error", "skipped")
    return {name: {k: v for k, v in got.items() if k in keep} for name, got in parts.items()}


# Tests that run on CUDA when it is there without the `gpu` mark (on CPU they run under the
# Triton interpreter): the CUDA definition's Triton kernels, compiled for the first time there.
CUDA_AWARE = ("tests/unit/test_cuda_kernels.py",)


def gpu_test_files() -> list[str]:
    """The test files that hold `gpu`-marked tests (collecting only these keeps the run short
    and away from the suite's other optional imports); ``$GPU_TEST_FILES`` (space-separated)
    picks some of them for a short second call."""
    picked = os.environ.get("GPU_TEST_FILES", "").split()
    if picked:
        return picked
    files = []
    for path in sorted((REPO / "tests").rglob("test_*.py")):
        if re.search(r"mark\.gpu\b", path.read_text(errors="replace")):
            files.append(str(path.relative_to(REPO)))
    return files


def steps(args: argparse.Namespace, out: Path, work: Path) -> list[Step]:
    py = sys.executable
    device = "cpu" if args.rehearse else "cuda"
    smoke = ["--smoke"] if args.rehearse else []

    def bench(name: str, budget: float, *extra: str) -> Step:
        step_work = work / name
        argv = [py, "-m", "oldlogit_service.cli", "bench", *extra, "--out", str(step_work)]
        return Step(name, budget, argv + smoke, _parse_bench, work=step_work)

    shaped = ["--device", device, "--shapes", SHAPES]

    def pytest(name: str, budget: float, marks: str, files: list[str], *extra: str) -> Step:
        xml = out / f"{name}.xml"
        argv = [py, "-m", "pytest", "-m", marks, *extra, "-v", "-rA", "-p", "no:cacheprovider"]
        argv += ["--continue-on-collection-errors", "-o", "timeout=90", "--durations=15"]
        argv += ["--junitxml", str(xml), *files]
        return Step(name, budget, argv, _parse_tests, f"{name}.log", work=xml)

    rehearse = args.rehearse
    kernels = [f for f in CUDA_AWARE if (REPO / f).is_file()]
    # Budgets (seconds, at most; 0: what is left) sized for an H100 inside the script's 540 s:
    # the first six fit in 525 s if each used all of its own; serving and throughput get the rest.
    return [
        Step("machine", 30, [py, "-c", MACHINE], _parse_machine),
        pytest("gpu-tests", 90 if rehearse else 160, "gpu", gpu_test_files()),
        # On the CPU they run interpreted (half a minute): the rehearsal runs one.
        pytest("kernel-tests", 60, "not slow", kernels,
               *(["-k", "rows_look_the_same"] if rehearse else [])),
        bench("invariant-vs-plain", 85, "invariant", *shaped, "--invariant-rounds", "3",
              "--invariant-reps", "2"),
        bench("patched-step-cost", 75, "parity", "--parity-only", "patched-step-cost", *shaped,
              "--parity-reps", "3"),
        bench("models-vs-hf-forward", 110, "models", *shaped, "--models-versions", "2",
              "--models-rounds", "1" if rehearse else "3"),
        bench("serving", 0, "serving", "--device", device, *(
            [] if rehearse else ["--dtype", "bfloat16", "--hidden", "896", "--layers", "12",
                                 "--vocab", "32768", "--seqs", "64", "--seq-len", "512"])),
        bench("throughput", 0, "throughput", "--device", device),
        # By name only (ONLY="profile"): where the time goes (benchmarks/gpu_profile.py).
        Step("profile", 150, [py, "-m", "benchmarks.gpu_profile", str(out), "--device", device,
                              "--budget-s", "120", *smoke], _parse_profile, by_name=True),
    ]  # fmt: skip


def goals_met(figures: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each figure with a goal: its value, the goal, and whether it was met."""
    rows = []
    for f in figures:
        goal = str(f.get("goal") or "")
        m = re.fullmatch(r"\s*(>=|<=)\s*([0-9.]+)\s*", goal)
        if not m:
            continue
        value, bound = float(f["value"]), float(m.group(2))
        met = value >= bound if m.group(1) == ">=" else value <= bound
        rows.append({"figure": f["figure"], "name": f["name"], "value": value, "goal": goal,
                     "met": bool(met) if value == value else None})  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_checks")
    p.add_argument("out", type=Path)
    p.add_argument("--rehearse", action="store_true", help="on the CPU, tiny sizes")
    p.add_argument("--budget-s", type=float, default=530.0, help="for all the steps")
    p.add_argument("--work", type=Path, default=None, help="bench outputs (default OUT/../work)")
    p.add_argument("--wheels", default="", help="the wheel install's summary (gpu_checks.sh)")
    p.add_argument("--only", nargs="+", default=None, help="run these steps only")
    args = p.parse_args(argv)
    start = time.monotonic()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    work = args.work or Path(f"/tmp/oldlogit-gpu-work-{os.getpid()}")
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    env["TRANSFORMERS_OFFLINE"] = "1"
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    report: dict[str, Any] = {
        "schema": SCHEMA,
        "rehearsal": args.rehearse,
        "started": _now(),
        "budget_s": args.budget_s,
        "shapes": SHAPES,
        "goals": GOALS,
        "wheels": args.wheels,
        "pythonpath": env.get("PYTHONPATH", ""),
        "machine": None,
        "tests": None,
        "kernel_tests": None,
        "figures": [],
        "goals_met": [],
        "steps": [],
        "wall_s": 0.0,
    }
    path = out / "gpu-checks.json"

    def write() -> None:
        report["wall_s"] = round(time.monotonic() - start, 1)
        report["goals_met"] = goals_met(report["figures"])
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(report, indent=2, default=str))
        tmp.replace(path)

    write()
    tests_failed = False
    for step in steps(args, out, work):
        if (args.only or step.by_name) and step.name not in (args.only or ()):
            continue
        left = args.budget_s - (time.monotonic() - start)
        timeout = left - 5 if step.budget_s == 0 else min(step.budget_s, left - 5)
        record: dict[str, Any] = {"name": step.name, "budget_s": step.budget_s, "argv": step.argv}
        if left < 25:  # too little for any step to start and finish
            record |= {"status": "skipped", "error": f"out of time ({left:.0f} s left)"}
            report["steps"].append(record)
            write()
            continue
        print(f"gpu_checks: {step.name} (at most {timeout:.0f} s)", flush=True)
        t0 = time.monotonic()
        try:
            rc, text = _run(step.name, step.argv, timeout, out / step.log, env)
        except KeyboardInterrupt:
            record |= {"status": "timeout", "wall_s": round(time.monotonic() - t0, 1)}
            record["error"] = "stopped by the script's time backstop (SIGINT)"
            report["steps"].append(record)
            write()
            return 1
        record |= {"timeout_s": round(timeout, 1), "wall_s": round(time.monotonic() - t0, 1)}
        record["returncode"] = rc
        if rc is None:
            record["status"] = "timeout"
        elif rc == 0 or (step.parse is _parse_tests and rc == 1):
            record["status"] = "ok"  # pytest's 1: tests failed (the summary says which)
        else:
            record["status"] = "failed"
        try:
            result = step.parse(step, text, out)
        except Exception as exc:  # recorded; the next step runs
            result = None
            record["status"] = "failed" if record["status"] == "ok" else record["status"]
            record["parse_error"] = f"{type(exc).__name__}: {exc}"
        if record["status"] != "ok":
            record["error_tail"] = _tail(text)
        # Figures go to the report's list once; the step keeps their count.
        record["result"] = f"{len(result)} figures" if isinstance(result, list) else result
        if step.name == "machine":
            report["machine"] = result
        elif step.parse is _parse_tests:
            report["tests" if step.name == "gpu-tests" else "kernel_tests"] = result
            tests_failed |= rc != 0 or not result or bool(result["failing"])
        elif isinstance(result, list):
            report["figures"].extend(result)
        report["steps"].append(record)
        print(f"gpu_checks: {step.name}: {record['status']} in {record['wall_s']} s", flush=True)
        write()
    write()
    print(f"gpu_checks: {path} ({report['wall_s']} s)")
    for key in ("tests", "kernel_tests"):  # what the call's output tail should show at once
        got = report[key]
        if got:
            print(f"  {key}: {got['passed']} passed, {got['failed']} failed, {got['errors']} "
                  f"errors, {got['skipped']} skipped; failing: {got['failing'][:20]}")  # fmt: skip
    for record in report["steps"]:
        if record["status"] != "ok":
            print(f"  step {record['name']}: {record['status']}")
    for row in report["goals_met"]:
        print(f"  {row['figure']:<22} {row['value']:8.3f} {row['goal']:<8} met={row['met']}  "
              f"{row['name']}")  # fmt: skip
    return 1 if tests_failed else 0


if __name__ == "__main__":
    sys.exit(main())
