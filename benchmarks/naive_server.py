"""The baseline a user would write instead of oldlogit: FastAPI + transformers, one forward
per request, no batching, and a version switch reloads the weights from its safetensors file.

Run: ``python -m benchmarks.naive_server --model DIR --versions DIR [--port 0]``; prints
``http=HOST:PORT``. ``POST /logprobs {"token_ids": [...], "policy_version": v}`` returns
``{"logprobs": [...]}`` for positions 1..n-1 (raw distribution).
"""

from __future__ import annotations

import argparse
import socket
import threading
from pathlib import Path
from typing import Any

import torch
import uvicorn
from fastapi import FastAPI
from pydantic import BaseModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM


def load_version(model: Any, versions_dir: Path, version: int | str) -> None:
    """Load version ``version``'s weights (``v{version}.safetensors``) into ``model``, on the
    model's device."""
    device = str(next(model.parameters()).device)
    state = load_file(str(Path(versions_dir) / f"v{version}.safetensors"), device=device)
    model.load_state_dict(state, strict=False)


def token_logprobs(model: Any, token_ids: list[int]) -> list[float]:
    """One transformers forward on one sequence: the float32 log-softmax of its logits,
    gathered at the tokens of positions 1..n-1 (raw distribution)."""
    ids = torch.tensor([token_ids], device=next(model.parameters()).device)
    with torch.inference_mode():
        logits = model(ids).logits.float()  # [1, T, V]
    lp = torch.log_softmax(logits[0, :-1], dim=-1)
    return list(lp.gather(-1, ids[0, 1:, None])[:, 0].tolist())


class Req(BaseModel):
    token_ids: list[int]
    policy_version: int


def create_app(
    model_dir: Path, versions_dir: Path, dtype: torch.dtype, device: str = "cpu"
) -> FastAPI:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval().to(device)
    lock = threading.Lock()
    current = {"version": None}
    app = FastAPI()

    @app.post("/logprobs")
    def logprobs(req: Req) -> dict[str, Any]:  # sync: FastAPI runs it in its thread pool
        with lock:
            if current["version"] != req.policy_version:
                load_version(model, versions_dir, req.policy_version)
                current["version"] = req.policy_version
            return {"logprobs": token_logprobs(model, req.token_ids)}

    return app


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--versions", type=Path, required=True)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--port", type=int, default=0)
    args = p.parse_args()
    app = create_app(args.model, args.versions, getattr(torch, args.dtype), args.device)
    # TCP named and Nagle off, as uvicorn.run(host=..., port=...) would bind it. uvicorn runs
    # this server on uvloop, which turns Nagle off on every TCP connection anyway; on asyncio's
    # own loop a socket that does not say TCP would keep it on, and each keep-alive response's
    # body would wait 40 ms for the client's delayed ACK of its head.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind(("127.0.0.1", args.port))
    # Listening before the port is printed: a client that reads it and connects at once is
    # queued until uvicorn accepts, not refused.
    sock.listen(1024)
    print(f"http=127.0.0.1:{sock.getsockname()[1]}", flush=True)
    # The benchmark's clients keep their connections across phases that can leave them idle
    # for seconds (other servers warming up and publishing). With uvicorn's default 5 s the
    # server may close one just as a client reuses it: "Connection reset by peer" on the
    # next request (seen under a sampling profiler). oldlogit serve keeps 30 s and its client
    # retries; this baseline keeps its connections for the benchmark's length instead.
    config = uvicorn.Config(app, log_level="warning", timeout_keep_alive=600)
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    main()
