"""A small demo rollout worker for the docker-compose ``demo`` profile, via the public client.

Each round it takes the newest version (the one an inference engine would sample with),
leases it so it cannot be evicted meanwhile, "samples" a random sequence, and asks the
replicas (routed and failed over by the client) for the training-side logprobs of the
sampled tokens under that version. It checks every answer is exact and logs its mean.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from pathlib import Path

import numpy as np

from oldlogit import Client

logger = logging.getLogger("oldlogit.demo.rollout_worker")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True, help="comma-separated replica URLs")
    ap.add_argument("--rounds", type=int, default=0, help="rounds to run (0: forever)")
    ap.add_argument("--interval-s", type=float, default=2.0, help="seconds between rounds")
    ap.add_argument("--seq-len", type=int, default=256, help="tokens per sampled sequence")
    ap.add_argument("--heartbeat", type=Path, help="file touched after each answered round")
    # TLS (docker-compose.tls.yml): https:// / grpcs:// URLs, a private CA, a client certificate.
    ap.add_argument("--ca-file", help="trust this CA (PEM) for https:// and grpcs:// URLs")
    ap.add_argument("--cert-file", help="client certificate (PEM), for mutual TLS")
    ap.add_argument("--key-file", help="the client certificate's key (PEM)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise

    token = os.environ.get("OLDLOGIT_WRITE_TOKEN")  # leases are writes
    rng = np.random.default_rng(0)
    tls = {"ca_file": args.ca_file, "cert_file": args.cert_file, "key_file": args.key_file}
    with Client(args.url.split(","), token=token, timeout_s=60.0, **tls) as c:
        vocab = c.info().vocab_size
        done = 0
        while args.rounds == 0 or done < args.rounds:
            version = max(v.policy_version for v in c.versions())
            with c.lease(version, ttl_s=120):
                token_ids = rng.integers(1, vocab, size=args.seq_len)
                prompt_len = args.seq_len // 4
                r = c.logprobs(token_ids, policy_version=version, score_from=prompt_len)
                if not r.exact or r.versions != [version]:
                    raise RuntimeError(f"expected an exact answer under version {version}: {r}")
                logger.info(
                    "version %d: mean logprob %.4f over %d tokens%s",
                    version,
                    float(np.nanmean(r.logprobs)),
                    args.seq_len - prompt_len,
                    " (cached)" if r.cached else "",
                )
            if args.heartbeat is not None:
                args.heartbeat.touch()
            done += 1
            time.sleep(args.interval_s)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
