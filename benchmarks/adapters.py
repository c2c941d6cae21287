"""LoRA adapter versions: what publishing, mixing and keeping many of them costs.

adapter-publish          a rank-16 all-linear adapter over Qwen2.5-0.5B shapes (random weights,
                         bf16 base, float32 adapter) sent with ``Client.publish_adapter`` ÷ the
                         same update as a delta of the merged weights (W + s·B·A in bf16,
                         ``Client.publish(delta=True)`` over the base): bytes sent, bytes stored,
                         seconds; HTTP and gRPC, the two arms in turn each round.
adapter-mixed-batches    batches whose sequences each name one of 16 adapters over one base ÷
                         the same batches on the base version alone (tokens/s, gRPC,
                         deterministic mode), the arms in turn each round; a few served rows
                         checked bitwise against the PEFT model's ``token_logprobs`` under
                         ``trainer_numerics``.
adapter-retention        1,000 adapters retained over one small base: disk bytes, the server's
                         resident-memory growth, and the first request for an adapter not in
                         memory ÷ the next request for it (p50/p90).
Every server is a real ``oldlogit serve`` subprocess on loopback (benchmarks/common.py).
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.common import Figure, ServerProcess

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTER_VERSIONS = 16  # adapter-mixed-batches: the adapters a batch mixes
RANK, ALPHA = 16, 32
# Qwen2.5-0.5B's shapes (its config.json); the weights are random (HF init, std 0.02).
QWEN05 = dict(
    vocab_size=151936,
    hidden_size=896,
    num_heads=14,
    num_kv_heads=2,
    intermediate_size=4864,
    tie_word_embeddings=True,
)
QWEN05_LAYERS = 24


def add_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("adapters (LoRA adapter versions)")
    g.add_argument(
        "--adapter-layers",
        type=int,
        default=QWEN05_LAYERS,
        help="adapter-publish: layers of the Qwen2.5-0.5B-shaped model (bytes scale per layer)",
    )
    g.add_argument(
        "--adapter-b-std",
        type=float,
        default=1e-3,
        help="adapter-publish: lora_B's std (PEFT starts it at 0; training moves it): how many "
        "bf16 elements the merged update changes",
    )
    g.add_argument("--adapter-publish-rounds", type=int, default=2)
    g.add_argument("--adapter-mixed-rounds", type=int, default=3)
    g.add_argument("--adapter-retained", type=int, default=1000)
    g.add_argument("--adapter-cold-samples", type=int, default=64)
    g.add_argument("--adapter-checked", type=int, default=3, help="adapters checked bitwise")
    p.set_defaults(adapter_tiny=False)  # --smoke: adapter-publish at tiny widths too


def smoke(args: argparse.Namespace) -> None:
    args.adapter_layers, args.adapter_publish_rounds, args.adapter_mixed_rounds = 2, 1, 1
    args.adapter_retained, args.adapter_cold_samples, args.adapter_checked = 24, 4, 2
    args.adapter_tiny = True


def _targets(layers: int) -> tuple[str, ...]:
    return tuple(
        sorted(
            f"model.layers.{i}.{'self_attn' if n[0] in 'qkvo' else 'mlp'}.{n}"
            for i in range(layers)
            for n in LINEARS
        )
    )


def _adapter(shapes: dict[str, tuple[int, ...]], layers: int, seed: int, b_std: float) -> Any:
    """A float32 rank-16 all-linear adapter: lora_A as PEFT initialises it (uniform
    ±1/sqrt(in)), lora_B ~ N(0, b_std) (PEFT starts it at 0; training moves it)."""
    from oldlogit.parity.lora import Adapter, LoraSpec

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for m in _targets(layers):
        out, inp = shapes[f"{m}.weight"]
        a = (torch.rand(RANK, inp, generator=gen) * 2 - 1) / inp**0.5
        tensors[f"{m}.lora_A"] = a
        tensors[f"{m}.lora_B"] = torch.randn(out, RANK, generator=gen) * b_std
    spec = LoraSpec(RANK, ALPHA, False, _targets(layers), "float32")
    return Adapter(spec, tensors)


def _merged(base: dict[str, torch.Tensor], adapter: Any) -> dict[str, torch.Tensor]:
    """The same update merged: W + s·B·A in float32, cast to the base's dtype."""
    s = adapter.spec.scaling
    out = dict(base)
    for m in adapter.spec.target_modules:
        w = base[f"{m}.weight"]
        ba = adapter.tensors[f"{m}.lora_B"] @ adapter.tensors[f"{m}.lora_A"]
        out[f"{m}.weight"] = (w.float() + s * ba).to(w.dtype)
    return out


class _Sent:
    """Counts the bytes each upload of a client sends (the safetensors body's total)."""

    def __init__(self, client: Any) -> None:
        self.last = 0
        pub = client._aio._publisher
        upload = pub.upload

        async def counted(policy_version: int, stream: Any, *a: Any, **kw: Any) -> Any:
            self.last = int(stream.total_bytes)
            return await upload(policy_version, stream, *a, **kw)

        pub.upload = counted


def _new_files(snap: Path, before: set[Path]) -> int:
    """Bytes of the files the store wrote since ``before`` (its weights directory)."""
    now = {p for p in (snap / "weights").iterdir() if not p.name.startswith(".")}
    return sum(p.stat().st_size for p in now - before)


def _files(snap: Path) -> set[Path]:
    return {p for p in (snap / "weights").iterdir() if not p.name.startswith(".")}


def _publish(args: argparse.Namespace, root: Path) -> list[Figure]:
    from safetensors.torch import load_file

    from oldlogit import Client
    from oldlogit_service.demo.tiny import make_tiny_model_dir

    layers = args.adapter_layers
    shape: dict[str, Any] = dict(QWEN05)
    if args.adapter_tiny:
        shape.update(vocab_size=512, hidden_size=64, num_heads=4, intermediate_size=128)
    t0 = time.perf_counter()
    model_dir = make_tiny_model_dir(
        root / "qwen05",
        arch="qwen2",
        seed=0,
        num_layers=layers,
        max_positions=1024,
        dtype="bfloat16",
        initializer_range=0.02,  # as real checkpoints: the bf16 spacing vs the update matters
        **shape,
    )
    base = load_file(str(model_dir / "model.safetensors"))
    build_s = time.perf_counter() - t0
    shapes = {k: tuple(v.shape) for k, v in base.items()}
    snap = root / "snap-publish"
    # This figure scores nothing, so the server runs the plain numerics: at these shapes in
    # bf16 the invariant numerics' start-up check (engine.self_check) refuses this CPU.
    srv = ServerProcess(
        [
            *("--model", str(model_dir), "--snapshot-dir", str(snap), "--dtype", "bfloat16"),
            *("--numerics", "hf", "--cache-budget-mib", "0", "--max-versions", "1024"),
        ]
    )
    rows: dict[str, dict[str, list[float]]] = {}
    changed: list[float] = []
    kinds: dict[str, set[str]] = {}  # arm -> how the store kept it
    version = 1
    try:
        for r in range(args.adapter_publish_rounds):
            adapter = _adapter(shapes, layers, seed=r, b_std=args.adapter_b_std)
            merged = _merged(base, adapter)
            n = sum(merged[f"{m}.weight"].numel() for m in adapter.spec.target_modules)
            diff = sum(
                int((merged[f"{m}.weight"] != base[f"{m}.weight"]).sum())
                for m in adapter.spec.target_modules
            )
            changed.append(diff / n)
            for transport in ("http", "grpc"):
                url = srv.http_url if transport == "http" else srv.grpc_url
                with Client(url, timeout_s=600) as c:
                    sent = _Sent(c)
                    t = time.perf_counter()
                    c.publish(0, base, delta=True)  # the delta's parent: version 0, untimed
                    row = rows.setdefault(transport, {})
                    row.setdefault("full_s", []).append(time.perf_counter() - t)
                    row.setdefault("full_sent", []).append(sent.last)
                    for arm in ("adapter", "delta"):
                        before = _files(snap)
                        t = time.perf_counter()
                        if arm == "adapter":
                            res = c.publish_adapter(version, adapter, base_version=0)
                        else:
                            res = c.publish(version, merged, delta=True)
                        row.setdefault(f"{arm}_s", []).append(time.perf_counter() - t)
                        row.setdefault(f"{arm}_sent", []).append(sent.last)
                        row.setdefault(f"{arm}_stored", []).append(_new_files(snap, before))
                        kinds.setdefault(arm, set()).add(res.kind)
                        version += 1
    finally:
        srv.stop()
    full_bytes = sum(t.numel() * t.element_size() for t in base.values())
    extrapolated = layers != QWEN05_LAYERS

    def med(xs: list[float]) -> float:
        return float(statistics.median(xs))

    figures = []
    for transport, row in rows.items():
        ratio_sent = med(row["adapter_sent"]) / med(row["delta_sent"])
        detail: dict[str, Any] = {k: v for k, v in row.items()}
        detail.update(
            layers=layers,
            full_weights_bytes=full_bytes,
            merged_changed_fraction=changed,
            kinds={arm: sorted(k) for arm, k in kinds.items()},
            adapter_stored_vs_delta_stored=med(row["adapter_stored"]) / med(row["delta_stored"]),
            adapter_s_vs_delta_s=[
                a / d for a, d in zip(row["adapter_s"], row["delta_s"], strict=True)
            ],
            adapter_sent_per_layer=med(row["adapter_sent"]) / layers,
            delta_sent_per_layer=med(row["delta_sent"]) / layers,
            model_build_s=build_s,
        )
        if extrapolated:  # LoRA tensors and the merged update both live in the layers only
            detail["extrapolated_24_layers"] = {
                "adapter_sent": detail["adapter_sent_per_layer"] * QWEN05_LAYERS,
                "delta_sent": detail["delta_sent_per_layer"] * QWEN05_LAYERS,
            }
        mb = 1 / 2**20
        detail["printed"] = (
            f"{layers} layers: adapter {med(row['adapter_sent']) * mb:.1f} MiB sent, "
            f"{med(row['adapter_stored']) * mb:.1f} MiB stored, {med(row['adapter_s']):.2f} s; "
            f"merged delta {med(row['delta_sent']) * mb:.1f} MiB sent, "
            f"{med(row['delta_stored']) * mb:.1f} MiB stored, {med(row['delta_s']):.2f} s"
        )
        figures.append(
            Figure(
                "adapter-publish",
                f"{transport}: adapter bytes sent ÷ merged-weights delta",
                ratio_sent,
                "ratio",
                "",
                detail,
            )
        )
        figures.append(
            Figure(
                "adapter-publish-time",
                f"{transport}: adapter publish seconds ÷ merged-weights delta",
                med(detail["adapter_s_vs_delta_s"]),
                "ratio",
                "",
            )
        )
    return figures


def _server(model_dir: Path, snap: Path, max_batch_tokens: int) -> ServerProcess:
    """The bench model served as throughput's versions server is (deterministic, no cache)."""
    return ServerProcess(
        [
            *("--model", str(model_dir), "--snapshot-dir", str(snap), "--dtype", "float32"),
            *("--mode", "deterministic", "--numerics", "invariant", "--cache-budget-mib", "0"),
            *("--max-wait-ms", "2", "--max-batch-tokens", str(max_batch_tokens)),
            *("--max-versions", "100000", "--disk-budget-gib", "1000"),
        ]
    )


def _peft_model(model_dir: Path) -> Any:
    import peft
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train(False)
    config = peft.LoraConfig(
        r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=list(LINEARS)
    )
    return peft.get_peft_model(model, config)


def _set_factors(pm: Any, seed: int) -> None:
    """Random lora_A and lora_B (lora_B nonzero, so the adapter moves the logprobs)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if ".lora_A." in name:
                p.copy_((torch.rand(p.shape, generator=gen) * 2 - 1) / p.shape[1] ** 0.5)
            elif ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _served(args: argparse.Namespace, root: Path) -> list[Figure]:
    from benchmarks.serving import build_model
    from oldlogit import Client, Sequence
    from oldlogit.parity import token_logprobs, trainer_numerics
    from oldlogit.parity.lora import adapter_from_peft

    model_dir = build_model(args, root)
    snap = root / "snap-served"
    srv = _server(model_dir, snap, args.seqs * args.seq_len)
    rng = random.Random(0)
    batch = [[rng.randrange(args.vocab) for _ in range(args.seq_len)] for _ in range(args.seqs)]
    pm = _peft_model(model_dir)
    figures: list[Figure] = []
    try:
        with Client(srv.grpc_url, timeout_s=600) as c:
            adapters = []
            for k in range(ADAPTER_VERSIONS):
                _set_factors(pm, seed=k)
                adapters.append(adapter_from_peft(pm))
                c.publish_adapter(1 + k, adapters[-1], base_version=0)
            mixed = [
                Sequence(token_ids=s, policy_version=1 + i % ADAPTER_VERSIONS)
                for i, s in enumerate(batch)
            ]
            whole = [Sequence(token_ids=s, policy_version=0) for s in batch]
            arms: dict[str, list[float]] = {"mixed": [], "whole": []}
            answers: list[Any] = []
            for r in range(args.adapter_mixed_rounds + 1):  # round 0 warms both up, untimed
                for arm in ("mixed", "whole") if r % 2 else ("whole", "mixed"):
                    seqs = mixed if arm == "mixed" else whole
                    times = []
                    for _ in range(max(1, args.reps)):
                        t = time.perf_counter()
                        res = c.logprobs_batch(seqs, use_cache=False)
                        times.append(time.perf_counter() - t)
                        if arm == "mixed" and not answers:
                            answers = res
                    if r:
                        arms[arm].append(statistics.median(times))
            spec = c.info().numerics_spec()
            # Exactness: a few adapters' rows against the PEFT model under trainer_numerics.
            checked = mismatched = 0
            for k in range(min(args.adapter_checked, ADAPTER_VERSIONS)):
                _set_factors(pm, seed=k)
                rows = [i for i in range(len(batch)) if i % ADAPTER_VERSIONS == k][:2]
                with torch.no_grad(), trainer_numerics(pm, like=spec):
                    for i in rows:
                        want = token_logprobs(pm, torch.tensor(batch[i])[None])[0].float().numpy()
                        got = np.asarray(answers[i].logprobs)
                        checked += 1
                        mismatched += int(not np.array_equal(got[1:], want[1:]))
            tokens = args.seqs * args.seq_len
            ratios = [w / m for m, w in zip(arms["mixed"], arms["whole"], strict=True)]
            figures.append(
                Figure(
                    "adapter-mixed-batches",
                    f"{ADAPTER_VERSIONS} adapters mixed per batch ÷ one whole-model version",
                    statistics.median(ratios),
                    "ratio",
                    ">= 0.8",
                    {
                        "round_ratios": ratios,
                        "mixed_tokens_per_s": [tokens / s for s in arms["mixed"]],
                        "whole_tokens_per_s": [tokens / s for s in arms["whole"]],
                        "batch": f"{args.seqs} x {args.seq_len}",
                        "rank": RANK,
                        "exact": mismatched == 0,
                        "checked_sequences": checked,
                        "mismatched_sequences": mismatched,
                        "printed": f"{checked} served rows checked bitwise against PEFT + "
                        f"trainer_numerics: {mismatched} differ",
                    },
                )
            )
            figures += _retention(args, c, srv, snap, adapters[0])
    finally:
        srv.stop()
    return figures


def _retention(
    args: argparse.Namespace, c: Any, srv: ServerProcess, snap: Path, adapter: Any
) -> list[Figure]:
    """adapter-retention on the mixed-batch server: --adapter-retained adapters over base 0."""
    from oldlogit.parity.lora import Adapter

    first = 1 + ADAPTER_VERSIONS
    count = args.adapter_retained
    before = _files(snap)
    rss0 = _rss_bytes(srv.proc.pid)
    t0 = time.perf_counter()
    for v in range(first, first + count):
        # Each its own tensors (another hash): lora_B scaled by the version.
        tensors = {
            k: t * (1 + v / count) if k.endswith("lora_B") else t
            for k, t in adapter.tensors.items()
        }
        c.publish_adapter(v, Adapter(adapter.spec, tensors), base_version=0)
    publish_s = time.perf_counter() - t0
    disk = _new_files(snap, before)
    rss_published = _rss_bytes(srv.proc.pid)
    rng = random.Random(1)
    sample = rng.sample(range(first, first + count), min(args.adapter_cold_samples, count))
    seq = [rng.randrange(args.vocab) for _ in range(args.single_len)]
    c.logprobs(seq, policy_version=0, use_cache=False)  # the base's forward warm
    cold: list[float] = []
    warm: list[float] = []
    for v in sample:
        for out in (cold, warm):
            t = time.perf_counter()
            c.logprobs(seq, policy_version=v, use_cache=False)
            out.append(time.perf_counter() - t)
    rss_served = _rss_bytes(srv.proc.pid)
    per_pair = sorted(a / b for a, b in zip(cold, warm, strict=True))

    def pct(xs: list[float], q: float) -> float:
        s = sorted(xs)
        return s[min(len(s) - 1, int(q * len(s)))]

    adapter_bytes = sum(t.numel() * t.element_size() for t in adapter.tensors.values())
    mb = 1 / 2**20
    return [
        Figure(
            "adapter-retention",
            f"{count} adapters: first request ÷ next, p50",
            pct(cold, 0.5) / pct(warm, 0.5),
            "ratio",
            "",
            {
                "adapters": count,
                "adapter_tensor_bytes": adapter_bytes,
                "disk_bytes": disk,
                "disk_bytes_per_adapter": disk / count,
                "publish_s": publish_s,
                "publish_per_adapter_s": publish_s / count,
                "rss_before_bytes": rss0,
                "rss_after_publish_bytes": rss_published,
                "rss_after_serving_bytes": rss_served,
                "rss_growth_publish_bytes": rss_published - rss0,
                "rss_growth_serving_bytes": rss_served - rss_published,
                "distinct_adapters_served": len(sample),
                "cold_p50_s": pct(cold, 0.5),
                "cold_p90_s": pct(cold, 0.9),
                "warm_p50_s": pct(warm, 0.5),
                "warm_p90_s": pct(warm, 0.9),
                "cold_over_warm_p90": pct(cold, 0.9) / pct(warm, 0.9),
                "pair_ratio_p50": pct(per_pair, 0.5),
                "pair_ratio_p90": pct(per_pair, 0.9),
                "tokens_per_request": args.single_len,
                "printed": f"disk {disk * mb:.0f} MiB ({disk / count / 1024:.0f} KiB each); "
                f"server RSS +{(rss_published - rss0) * mb:.0f} MiB after publishing, "
                f"+{(rss_served - rss_published) * mb:.0f} MiB after serving {len(sample)}; "
                f"cold p50/p90 {1e3 * pct(cold, 0.5):.1f}/{1e3 * pct(cold, 0.9):.1f} ms, "
                f"warm {1e3 * pct(warm, 0.5):.1f}/{1e3 * pct(warm, 0.9):.1f} ms",
            },
        )
    ]


def run(args: argparse.Namespace) -> list[Figure]:
    root = Path(tempfile.mkdtemp(prefix="oldlogit-bench-adapters-"))
    return _publish(args, root) + _served(args, root)
