"""The README's commands and code blocks, and docs/*.md's python blocks, still work against a
live demo server (``serve`` with ``--demo``'s settings, on a thread of this process;
tests/e2e/test_cli.py runs ``oldlogit serve --demo`` itself)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import REPO, DemoThread

pytestmark = pytest.mark.e2e

README = (REPO / "README.md").read_text()
# The docs' python blocks run too, after the README's (in file-name order).
DOCS = README + "".join(p.read_text() for p in sorted((REPO / "docs").glob("*.md")))


def _blocks(lang: str, text: str = README) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def _localize(text: str, srv: DemoThread) -> str:
    port_http = srv.http.rsplit(":", 1)[1]
    port_grpc = srv.grpc.rsplit(":", 1)[1]
    return text.replace("localhost:8000", f"127.0.0.1:{port_http}").replace(
        "localhost:50051", f"127.0.0.1:{port_grpc}"
    )


def test_quick_start_is_two_make_targets() -> None:
    first = _blocks("bash")[0]
    cmds = [line.split("#")[0].strip() for line in first.splitlines() if line.strip()]
    assert cmds == ["make demo", "make test"]
    makefile = (REPO / "Makefile").read_text()
    assert "oldlogit serve --demo" in makefile
    assert re.search(r"^test:.*\n\t\$\(PY\) -m pytest", makefile, flags=re.M)
    ci = (REPO / ".ci" / "run").read_text()
    assert "make test" in ci


def test_curl_example(demo_in_process: DemoThread) -> None:
    curl_blocks = [b for b in _blocks("bash") if b.lstrip().startswith("curl")]
    assert curl_blocks
    for block in curl_blocks:
        out = subprocess.run(
            ["bash", "-c", _localize(block, demo_in_process)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        body = json.loads(out.stdout)
        (res,) = body["results"]
        assert res["versions"] == [2] and res["exact"] is True
        assert len(res["logprobs"]) == 4  # positions 2..5: only scored values travel


def test_python_examples(demo_in_process: DemoThread, tmp_path: Path) -> None:
    blocks = _blocks("python", DOCS)
    assert len(blocks) >= 2
    # Trainer blocks use `model`: the demo architecture holding the demo's version 0 (a block
    # that publishes gets other weights, so its publish creates a version), and `tokenizer`: a
    # word-level tokenizer over its vocabulary ("w0" … ; no hub).
    prelude = (
        "import torch\n"
        "from transformers import AutoModelForCausalLM\n"
        "from oldlogit_service.demo.deployment import DEMO_MODEL_KWARGS\n"
        "from oldlogit_service.demo.tiny import make_tiny_model_dir\n"
        f"_d = make_tiny_model_dir({str(tmp_path / 'm')!r}, **DEMO_MODEL_KWARGS)\n"
        "model = AutoModelForCausalLM.from_pretrained(_d, dtype=torch.bfloat16)\n"
    )
    tokenizer = (
        "from tests.architectures import word_tokenizer\n"
        "tokenizer = word_tokenizer(model.config.vocab_size)\n"
        "model.generation_config.pad_token_id = tokenizer.pad_token_id\n"
        "model.generation_config.eos_token_id = tokenizer.eos_token_id\n"
    )
    scripts = []
    for i, block in enumerate(blocks):
        code = _localize(block, demo_in_process)
        words = re.findall(r"\b\w+\b", code)
        if "model" in words and "def " not in code:
            changed = "model.model.norm.weight.data += 0.5\n" if "publish(" in code else ""
            code = prelude + (tokenizer if "tokenizer" in words else "") + changed + code
        script = tmp_path / f"block{i}.py"
        script.write_text(code)
        scripts.append(script)
    # One interpreter runs the blocks in order, each as its own __main__ in a fresh namespace
    # (as `python blockN.py` would; torch and transformers are imported once, not nine times).
    out = subprocess.run(
        [sys.executable, "-c", _RUNNER, *map(str, scripts)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},  # the prelude's test helpers
    )
    for i, block in enumerate(blocks):
        done = tmp_path / f"block{i}.py.out"
        assert done.exists(), f"python block {i} (README, then docs/) failed:\n{out.stderr}"
        if "# True" in block:  # a block whose last line prints what the comment promises
            printed = done.read_text()
            assert printed.strip().splitlines()[-1] == "True", printed
    assert out.returncode == 0, out.stderr


# Runs each script given as an argument like `python script`, in order; a script's stdout goes
# to script + ".out" once it has finished, and the first failure stops the run with its traceback.
_RUNNER = """
import contextlib, io, runpy, sys
for path in sys.argv[1:]:
    buf = io.StringIO()
    sys.argv = [path]
    with contextlib.redirect_stdout(buf):
        runpy.run_path(path, run_name="__main__")
    with open(path + ".out", "w") as f:
        f.write(buf.getvalue())
"""
