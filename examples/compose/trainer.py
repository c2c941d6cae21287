"""A small demo trainer for the docker-compose ``demo`` profile, through the public client only.

It loads the model the service serves (``--model-dir``) with transformers, then every
``--interval-s`` nudges a few weights the way an optimizer step does, publishes the result as
the next policy version, and moves the watermark so only the last ``--keep`` versions are
asked for. It stands in for a real trainer: nothing here is needed to run oldlogit.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from oldlogit import Client

logger = logging.getLogger("oldlogit.demo.trainer")


def nudge(model: torch.nn.Module, gen: torch.Generator, fraction: float = 0.01) -> None:
    """One fake optimizer step: a random ``fraction`` of each tensor's elements move a little."""
    with torch.no_grad():
        for p in model.parameters():
            mask = torch.rand(p.shape, generator=gen) < fraction
            step = torch.randn(p.shape, generator=gen) * 0.01
            p.copy_(torch.where(mask, p.float() + step, p.float()).to(p.dtype))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True, help="comma-separated replica URLs (failover)")
    ap.add_argument("--model-dir", type=Path, required=True, help="the model the service serves")
    ap.add_argument("--steps", type=int, default=0, help="versions to publish (0: forever)")
    ap.add_argument("--interval-s", type=float, default=10.0, help="seconds between versions")
    ap.add_argument("--keep", type=int, default=8, help="versions kept above the watermark")
    ap.add_argument("--heartbeat", type=Path, help="file touched after each published version")
    # TLS (docker-compose.tls.yml): https:// / grpcs:// URLs, a private CA, a client certificate.
    ap.add_argument("--ca-file", help="trust this CA (PEM) for https:// and grpcs:// URLs")
    ap.add_argument("--cert-file", help="client certificate (PEM), for mutual TLS")
    ap.add_argument("--key-file", help="the client certificate's key (PEM)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise

    token = os.environ.get("OLDLOGIT_WRITE_TOKEN")  # publishing and the watermark are writes
    tls = {"ca_file": args.ca_file, "cert_file": args.cert_file, "key_file": args.key_file}
    with Client(args.url.split(","), token=token, timeout_s=120.0, **tls) as c:
        info = c.info()
        dtype = getattr(torch, info.dtype)  # publish in the serving dtype, as the service keeps it
        model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=dtype)
        version = max((v.policy_version for v in c.versions()), default=-1) + 1
        gen = torch.Generator().manual_seed(version)
        step = 0
        while args.steps == 0 or step < args.steps:
            nudge(model, gen)
            res = c.publish(version, model.state_dict())
            logger.info("published version %d sha256=%s", version, res.weight_sha256[:16])
            if version - args.keep >= 0:
                c.set_watermark(version - args.keep)
            if args.heartbeat is not None:
                args.heartbeat.touch()
            version, step = version + 1, step + 1
            time.sleep(args.interval_s)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
