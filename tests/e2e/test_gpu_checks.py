"""scripts/gpu_checks.sh, the one call a lent GPU machine gets: its steps' bookkeeping (fast,
with stand-in steps) and its CPU rehearsal end to end (slow), the results JSON's schema."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks import gpu_checks

from .conftest import REPO

pytestmark = pytest.mark.e2e

STEP_KEYS = {"name", "budget_s", "argv", "status"}


def _check_schema(report: dict[str, Any]) -> None:
    assert report["schema"] == gpu_checks.SCHEMA
    keys = ("machine", "tests", "kernel_tests", "figures", "goals_met", "steps", "wall_s", "wheels")
    for key in keys:
        assert key in report, key
    for step in report["steps"]:
        assert step.keys() >= STEP_KEYS, step
        assert step["status"] in ("ok", "failed", "timeout", "skipped"), step
        if step["status"] == "ok":
            assert step["result"] is not None, step
        else:  # every step that did not finish says why
            assert step.get("error_tail") or step.get("error"), step


def _fake_steps(tmp: Path) -> list[gpu_checks.Step]:
    py = sys.executable
    ok_work = tmp / "ok"
    figure = {"figure": "invariant-vs-plain", "name": "row", "value": 0.5, "unit": "ratio"}
    figure |= {"goal": ">= 0.90", "detail": {}}
    write = (
        f"import json, pathlib; p = pathlib.Path({str(ok_work)!r}); p.mkdir(parents=True); "
        f"(p / 'results.json').write_text(json.dumps({{'figures': [{figure!r}]}}))"
    )
    machine = "import json; print('MACHINE=' + json.dumps({'python': '3.12', 'torch': '2.11'}))"
    return [
        gpu_checks.Step("machine", 30, [py, "-c", machine], gpu_checks._parse_machine),
        gpu_checks.Step("bench-ok", 30, [py, "-c", write], gpu_checks._parse_bench, work=ok_work),
        gpu_checks.Step(
            "bench-fails",
            30,
            [py, "-c", "raise SystemExit('boom: no CUDA')"],
            gpu_checks._parse_bench,
            work=tmp / "none",
        ),
        gpu_checks.Step(
            "bench-hangs",
            1,
            [py, "-c", "import time; print('started', flush=True); time.sleep(60)"],
            gpu_checks._parse_bench,
            work=tmp / "none",
        ),
    ]


def test_steps_recorded_whatever_happens(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step that fails or outlives its budget is recorded with its output's tail, and the
    next one runs; figures and goals land in the report."""
    monkeypatch.setattr(gpu_checks, "steps", lambda args, out, work: _fake_steps(tmp_path))
    work = ["--work", str(tmp_path / "work")]
    rc = gpu_checks.main([str(tmp_path / "out"), "--rehearse", "--budget-s", "120", *work])
    assert rc == 0  # no test step ran: nothing failed
    report = json.loads((tmp_path / "out" / "gpu-checks.json").read_text())
    _check_schema(report)
    status = {s["name"]: s["status"] for s in report["steps"]}
    assert status == {
        "machine": "ok",
        "bench-ok": "ok",
        "bench-fails": "failed",
        "bench-hangs": "timeout",
    }
    by_name = {s["name"]: s for s in report["steps"]}
    assert "boom: no CUDA" in by_name["bench-fails"]["error_tail"]
    assert "started" in by_name["bench-hangs"]["error_tail"]
    assert by_name["bench-hangs"]["wall_s"] < 30
    assert report["machine"]["torch"] and report["machine"]["python"]
    assert report["goals_met"] == [
        {
            "figure": "invariant-vs-plain",
            "name": "row",
            "value": 0.5,
            "goal": ">= 0.90",
            "met": False,
        }
    ]
    assert report["figures"][0]["step"] == "bench-ok"
    assert "bench-fails" in (tmp_path / "out" / "steps.log").read_text()


def test_out_of_time_steps_are_skipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu_checks, "steps", lambda args, out, work: _fake_steps(tmp_path)[2:])
    gpu_checks.main([str(tmp_path / "out"), "--budget-s", "10", "--work", str(tmp_path / "w")])
    report = json.loads((tmp_path / "out" / "gpu-checks.json").read_text())
    _check_schema(report)
    assert [s["status"] for s in report["steps"]] == ["skipped", "skipped"]


def test_test_summary_from_junit_and_from_a_cut_log(tmp_path: Path) -> None:
    xml = tmp_path / "junit.xml"
    xml.write_text(
        '<?xml version="1.0"?><testsuites><testsuite tests="4">'
        '<testcase classname="tests.unit.test_a" name="test_ok" time="1.5"/>'
        '<testcase classname="tests.unit.test_a" name="test_bad" time="0.2">'
        '<failure message="assert 1 == 2">trace</failure></testcase>'
        '<testcase classname="tests.unit.test_a" name="test_gone" time="0">'
        '<skipped type="pytest.skip" message="needs two GPUs"/></testcase>'
        '<testcase classname="" name="tests.unit.test_b" time="0">'
        '<error message="collection failure">ImportError</error></testcase>'
        '<testcase time="0.000" />'  # the test a SIGINT stopped
        "</testsuite></testsuites>"
    )
    got = gpu_checks.summarize_tests(xml, "")
    assert (got["passed"], got["failed"], got["skipped"], got["errors"]) == (1, 1, 1, 1)
    assert got["failing"] == ["tests.unit.test_a::test_bad", "::tests.unit.test_b"]
    assert got["messages"]["tests.unit.test_a::test_bad"] == "assert 1 == 2"
    assert got["skip_reasons"] == {"needs two GPUs": 1}
    assert next(iter(got["slowest_s"])) == "tests.unit.test_a::test_ok"
    log = (
        "tests/unit/test_a.py::test_ok PASSED        [ 33%]\n"
        "tests/unit/test_a.py::test_p[bf16-2] FAILED [ 66%]\n"
        "tests/unit/test_a.py::test_s SKIPPED (needs CUDA) [100%]\n"
    )
    got = gpu_checks.summarize_tests(tmp_path / "missing.xml", log)
    assert (got["passed"], got["failed"], got["skipped"], got["source"]) == (1, 1, 1, "log")
    assert got["failing"] == ["tests/unit/test_a.py::test_p[bf16-2]"]
    assert gpu_checks.interrupted_test(log) is None
    cut = log + "tests/unit/test_b.py::test_long \n"  # SIGINT while it ran: no outcome
    assert gpu_checks.interrupted_test(cut) == "tests/unit/test_b.py::test_long"


def test_gpu_test_files_and_the_device_call() -> None:
    files = gpu_checks.gpu_test_files()
    assert "tests/unit/test_engine.py" in files and all(f.startswith("tests/") for f in files)
    script = (REPO / "scripts" / "gpu_checks.sh").read_text()
    call = 'run(command="bash scripts/gpu_checks.sh", carry=[".whl"], timeout_s=600)'
    assert call in script
    assert call in (REPO / "docs" / "performance.md").read_text()
    assert "/.whl/" in (REPO / ".gitignore").read_text().splitlines()


def test_the_profile_step_runs_by_name_only_and_gpu_test_files_can_be_picked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import argparse

    args = argparse.Namespace(rehearse=True)
    by_name = [s.name for s in gpu_checks.steps(args, tmp_path, tmp_path) if s.by_name]
    assert by_name == ["profile"]
    ran: list[str] = []

    def fake(name: str, argv: list[str], timeout_s: float, log: Path, env: dict[str, str]):  # type: ignore[no-untyped-def]
        ran.append(name)
        if name == "profile":
            (tmp_path / "out").mkdir(exist_ok=True)
            parts = {"invariant 1x512": {"wall_ms": 10.0, "host_ms": 9.0, "top_python": []}}
            (tmp_path / "out" / "gpu-profile.json").write_text(json.dumps({"parts": parts}))
            return 0, ""
        return 1, "not run"

    monkeypatch.setattr(gpu_checks, "_run", fake)
    gpu_checks.main([str(tmp_path / "out"), "--rehearse", "--budget-s", "100",
                     "--work", str(tmp_path / "w"), "--only", "profile"])  # fmt: skip
    assert ran == ["profile"]
    report = json.loads((tmp_path / "out" / "gpu-checks.json").read_text())
    step = report["steps"][0]
    assert step["status"] == "ok"
    assert step["result"] == {"invariant 1x512": {"wall_ms": 10.0, "host_ms": 9.0}}
    ran.clear()
    gpu_checks.main([str(tmp_path / "out2"), "--rehearse", "--budget-s", "100",
                     "--work", str(tmp_path / "w2")])  # fmt: skip
    assert "profile" not in ran and "machine" in ran  # not without its name
    monkeypatch.setenv("GPU_TEST_FILES", "tests/unit/test_engine.py")
    assert gpu_checks.gpu_test_files() == ["tests/unit/test_engine.py"]


def test_py_spy_stacks_are_read_per_python_line_and_native_frame() -> None:
    from benchmarks.gpu_profile import _collapsed_top

    raw = "\n".join(
        [
            "thread (1): oldlogit-compute;run (a.py:10);call (b.py:835);"
            "cudaMemcpy (libcudart.so) 30",
            "thread (1): oldlogit-compute;run (a.py:10);gemm (c.py:5) 10",
            "thread (2): MainThread;select (selectors.py:468);epoll_wait (libc.so.6) 60",
        ]
    )
    rows = _collapsed_top(raw, 5)
    functions = {r["function"]: r["share"] for r in rows if "function" in r}
    assert functions == {"select (selectors.py)": 0.6, "call (b.py)": 0.3, "gemm (c.py)": 0.1}
    lines = [r["line"] for r in rows if "line" in r]
    assert lines[1] == "call (b.py:835) <- cudaMemcpy (libcudart.so)"
    compute = {r["compute"]: r["share"] for r in rows if "compute" in r}
    assert compute == {"call (b.py:835) <- cudaMemcpy (libcudart.so)": 0.75, "gemm (c.py:5)": 0.25}
    assert rows[-1]["threads"] == {
        "thread (2): MainThread": 0.6,
        "thread (1): oldlogit-compute": 0.4,
    }


@pytest.mark.slow
def test_rehearsal_end_to_end(tmp_path: Path) -> None:
    """The whole script on the CPU at tiny sizes, from PYTHONPATH (no installed package
    needed): every step recorded a result or an error, the same schema as on the GPU."""
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable, "BUDGET_S": "420"}
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(
        ["bash", "scripts/gpu_checks.sh", "--rehearse", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=480,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "gpu-checks.json").read_text())
    _check_schema(report)
    assert report["rehearsal"] is True
    assert report["pythonpath"].split(":")[:3] == [
        str(REPO / "client"),
        str(REPO / "service"),
        str(REPO),
    ]
    assert report["machine"]["oldlogit_from"] == str(REPO / "client" / "oldlogit" / "__init__.py")
    names = [s["name"] for s in report["steps"]]
    assert names[:6] == [
        "machine",
        "gpu-tests",
        "kernel-tests",
        "invariant-vs-plain",
        "patched-step-cost",
        "models-vs-hf-forward",
    ]
    assert all(s["status"] == "ok" for s in report["steps"][:6]), report["steps"]
    tests = report["tests"]
    assert tests["skipped"] > 0 and tests["failed"] == tests["errors"] == 0  # no CUDA: all skip
    assert report["kernel_tests"]["passed"] == 1, report["kernel_tests"]  # interpreted here
    rows = {(f["figure"], f["name"]) for f in report["figures"]}
    for figure in ("invariant-vs-plain", "patched-step-cost", "models-vs-hf-forward"):
        assert sum(1 for f, _ in rows if f == figure) == 3, (figure, rows)
    inv = [f for f in report["figures"] if f["figure"] == "invariant-vs-plain"]
    assert all(f["detail"]["batch_invariant"]["invariant"] for f in inv if "4 × 32" in f["name"])
    (start,) = [f for f in report["figures"] if f["figure"] == "models-start"]
    assert any("self-check" in line for line in start["detail"]["self_check"])
    files = {p.name for p in out.iterdir()}
    assert {"gpu-checks.json", "gpu-tests.log", "gpu-tests.xml", "steps.log"} <= files
    assert {"kernel-tests.log", "kernel-tests.xml"} <= files
    assert len(files) <= 8  # what a device call brings back
