"""The asynchronous RL loop: a stale rollout worker with partial rollouts, a trainer that
publishes every step to a real oldlogit service, and four ways to fill the "old" slot.

Asynchrony is simulated deterministically so the four runs see the same schedule: the worker
samples with the weights the trainer had ``lag`` versions ago, and is interrupted every
``chunk`` tokens by a weight update, so one response spans two versions. Everything else is
real: the service (HTTP + gRPC on 127.0.0.1), the publishes, the per-token-version requests.
"""

from __future__ import annotations

import math
import tempfile
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rl_policy import Sampler, build_model, save_model_dir, state_dict, token_logprobs
from rl_task import correctness, make_prompts, prompt_len

from oldlogit import Client, Sequence
from oldlogit.correction import (
    DISCREPANCY_PREFIX,
    STALENESS_PREFIX,
    CorrectionConfig,
    corrected_ppo_loss,
    two_term_metrics,
)
from oldlogit_service.config import Settings
from oldlogit_service.server import ServerThread

VARIANTS = {
    "recompute": "(a) old = recomputed at the current weights",
    "behaviour": "(b) old = behaviour logprobs mu",
    "exact": "(c) old = exact old logits (oldlogit)",
    "ewma": "(d) old = EWMA proxy (oldlogit, inexact)",
}


@dataclass(frozen=True)
class Config:
    steps: int = 120
    batch: int = 128
    digits: int = 3  # K: the prompt holds K digits, the response K tokens
    lag: int = 2  # the worker samples with the weights of version (trainer version − lag)
    chunk: int = 2  # tokens generated per tick before the worker is interrupted
    lr: float = 5e-4
    epochs: int = 2
    minibatches: int = 2
    sft_steps: int = 20  # supervised warm-up: RL starts from a weak "pretrained" model
    ewma_beta: float = 0.7
    clip: float = 0.2
    dual_clip: float = 3.0  # caps the loss of A < 0 tokens whose ratio ran far (verl's c)
    is_threshold: float = 2.0
    engine: str = "fp8"  # the rollout engine's numerics: "fp8" weights or "bf16"
    seed: int = 0


SMOKE = Config(steps=3, batch=16, sft_steps=2)


@dataclass
class Rollout:
    ids: list[int]
    digits: torch.Tensor  # [K]
    versions: list[int]  # per token; −1 for the prompt
    mu: list[float]  # per token; 0 for the prompt


class RolloutWorker:
    """Keeps ``batch × ticks-per-response`` rollouts in flight; a tick adds ``chunk`` tokens."""

    def __init__(self, cfg: Config, gen: torch.Generator) -> None:
        self.cfg = cfg
        self.gen = gen
        self.sampler = Sampler(cfg.seed, cfg.engine)
        self.weights: dict[int, dict[str, torch.Tensor]] = {}  # broadcast copies it received
        ticks = math.ceil(cfg.digits / cfg.chunk)
        self.pool_size = cfg.batch * ticks
        self.pool: list[Rollout] = []
        self.ready: deque[Rollout] = deque()

    def receive(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        self.weights[version] = weights
        for v in [v for v in self.weights if v < version - self.cfg.lag - 1]:
            del self.weights[v]

    def tick(self, trainer_version: int) -> None:
        v = max(0, trainer_version - self.cfg.lag)
        if self.sampler.version != v:
            self.sampler.load(v, self.weights[v])
        k = self.cfg.digits
        while len(self.pool) < self.pool_size:
            ids, digits = make_prompts(self.gen, 1, k)
            n = prompt_len(k)
            self.pool.append(Rollout(ids[0].tolist(), digits[0], [-1] * n, [0.0] * n))
        by_len: dict[int, list[Rollout]] = {}
        for r in self.pool:
            by_len.setdefault(len(r.ids), []).append(r)
        for group in by_len.values():
            for _ in range(self.cfg.chunk):
                todo = [r for r in group if len(r.ids) < prompt_len(k) + k]
                if not todo:
                    break
                nxt, mu = self.sampler.step(torch.tensor([r.ids for r in todo]), self.gen)
                for r, tok, lp in zip(todo, nxt.tolist(), mu.tolist(), strict=True):
                    r.ids.append(tok)
                    r.versions.append(v)
                    r.mu.append(lp)
        done = [r for r in self.pool if len(r.ids) == prompt_len(k) + k]
        self.pool = [r for r in self.pool if len(r.ids) < prompt_len(k) + k]
        self.ready.extend(done)

    def take(self, n: int, trainer_version: int) -> list[Rollout]:
        while len(self.ready) < n:
            self.tick(trainer_version)
        return [self.ready.popleft() for _ in range(n)]


def _service_logprobs(c: Client, batch: list[Rollout], proxy: str | None) -> torch.Tensor:
    """[B, T] training-side logprobs at each token's version (NaN at the prompt)."""
    seqs = [Sequence(token_ids=r.ids, versions=r.versions) for r in batch]
    res = c.logprobs_batch(seqs, proxy=proxy)  # type: ignore[arg-type]
    for r in res:  # the contract the example relies on
        assert r.exact is (proxy is None), "exact answers must say so, approximations must not"
    return torch.stack([torch.from_numpy(r.logprobs) for r in res]).double()


def sft(model: torch.nn.Module, cfg: Config, gen: torch.Generator) -> None:
    """A few supervised steps: the weak starting point RL improves on."""
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(cfg.sft_steps):
        ids, digits = make_prompts(gen, cfg.batch, cfg.digits)
        full = torch.cat([ids, digits.flip(-1)], dim=1)
        lp = token_logprobs(model, full)[:, prompt_len(cfg.digits) :]
        opt.zero_grad()
        (-lp.mean()).backward()
        opt.step()


@dataclass
class Run:
    variant: str
    records: list[dict[str, Any]] = field(default_factory=list)


def run_variant(
    cfg: Config, variant: str, base_dir: Path, log: Callable[[str], None] = print
) -> Run:
    """Train one run from the same start; return one record per step."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {sorted(VARIANTS)}, got {variant!r}")
    gen = torch.Generator().manual_seed(cfg.seed)
    model = build_model(cfg.seed)
    sft(model, cfg, gen)
    work = Path(tempfile.mkdtemp(prefix=f"{variant}-", dir=base_dir))
    model_dir = save_model_dir(model, work / "model")  # the service publishes it as version 0
    settings = Settings(
        model=model_dir,
        snapshot_dir=work / "snapshots",
        http_port=0,
        grpc_port=0,
        dtype="float32",
        ewma_beta=cfg.ewma_beta,
        max_wait_ms=0.5,
    )
    corr_cfg = CorrectionConfig(
        is_level="token",
        is_threshold=cfg.is_threshold,
        veto_floor=1e-4,
        clip_low=cfg.clip,
        dual_clip=cfg.dual_clip,
    )
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    worker = RolloutWorker(cfg, gen)
    worker.receive(0, state_dict(model))
    run = Run(variant)
    n_prompt = prompt_len(cfg.digits)
    with ServerThread(settings) as server, Client(server.grpc_url, timeout_s=120) as c:
        for step in range(cfg.steps):
            t0 = time.perf_counter()
            batch = worker.take(cfg.batch, trainer_version=step)
            ids = torch.tensor([r.ids for r in batch])  # [B, T]
            versions = torch.tensor([r.versions for r in batch])  # [B, T]
            mu = torch.tensor([r.mu for r in batch], dtype=torch.float64)  # [B, T]
            mask = versions >= 0  # the response tokens
            right = correctness(ids[:, n_prompt:], torch.stack([r.digits for r in batch]))
            adv = torch.zeros(ids.shape, dtype=torch.float64)
            adv[:, n_prompt:] = right - right.mean(dim=0, keepdim=True)  # per-position baseline
            with torch.no_grad():
                current = token_logprobs(model, ids).double()  # θ_step, before this step
            exact_old = _service_logprobs(c, batch, None)
            old = {
                "recompute": current,
                "behaviour": mu,
                "exact": exact_old,
                "ewma": _service_logprobs(c, batch, "ewma") if variant == "ewma" else None,
            }[variant]
            assert old is not None
            seen = two_term_metrics(current, old, mu, mask, threshold=cfg.is_threshold)
            true = two_term_metrics(current, exact_old, mu, mask, threshold=cfg.is_threshold)
            clipfracs: list[float] = []
            flags: set[str] = set()
            for _ in range(cfg.epochs):
                perm = torch.randperm(cfg.batch, generator=gen)
                for idx in perm.chunk(cfg.minibatches):
                    cur = token_logprobs(model, ids[idx])
                    out = corrected_ppo_loss(cur, old[idx], mu[idx], adv[idx], mask[idx], corr_cfg)
                    opt.zero_grad()
                    out.loss.backward()
                    opt.step()
                    clipfracs.append(out.metrics["actor/pg_clipfrac"])
                    flags.update(f"{f.metric.split('/')[0]}:{f.name}" for f in out.flags)
            c.publish(step + 1, state_dict(model))
            worker.receive(step + 1, state_dict(model))
            rec = {
                "variant": variant,
                "step": step,
                "reward": float(right.mean()),
                "clipfrac": sum(clipfracs) / len(clipfracs),
                "disc_k3": seen[DISCREPANCY_PREFIX + "k3_kl"],
                "stale_k3": seen[STALENESS_PREFIX + "k3_kl"],
                "disc_kl": seen[DISCREPANCY_PREFIX + "kl"],
                "stale_kl": seen[STALENESS_PREFIX + "kl"],
                "disc_weight_mean": seen[DISCREPANCY_PREFIX + "rollout_is_mean"],
                "true_disc_k3": true[DISCREPANCY_PREFIX + "k3_kl"],
                "true_stale_k3": true[STALENESS_PREFIX + "k3_kl"],
                "staleness_versions": float(step - versions[mask].double().mean()),
                "flags": sorted(flags),
                "seconds": time.perf_counter() - t0,
            }
            run.records.append(rec)
            if step % 10 == 0 or step == cfg.steps - 1:
                log(
                    f"{variant:9s} step {step:4d}  reward {rec['reward']:.3f}  "
                    f"clip {rec['clipfrac']:.3f}  disc k3 {rec['disc_k3']:.2e}  "
                    f"stale k3 {rec['stale_k3']:.2e}  ({rec['seconds']:.2f}s)"
                )
    return run
