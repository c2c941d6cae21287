"""Adapter versions end to end: a PEFT adapter published over a served base (HTTP and gRPC),
listed with its base, refused by name, and served bitwise equal to the trainer's
``token_logprobs`` of the PEFT model under ``trainer_numerics``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from oldlogit import Client, Sequence
from oldlogit.contract.adapters import ADAPTER_CONFIG_KEY, AdapterConfig
from oldlogit.contract.errors import (
    Conflict,
    InvalidRequest,
    UnknownVersion,
    VersionConflict,
    WeightsMismatch,
)
from oldlogit.parity import token_logprobs, trainer_numerics
from oldlogit.publishing.adapters import AdapterUpload

from .conftest import WRITE_TOKEN, Served, start_served

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.integration

BASE = 3  # a full-weights version start_served publishes


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[Served]:
    s = start_served(tmp_path_factory.mktemp("adapters"), model_dir)
    yield s
    s.server.stop()


def _peft_model(served: Served, model_dir: Path, seed: int, **lora: Any) -> Any:
    """The trainer's model at version ``BASE`` with a LoRA adapter of random factors."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    model.load_state_dict(served.weights[BASE])
    pm = peft.get_peft_model(model.eval(), peft.LoraConfig(lora_dropout=0.0, **lora))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if ".lora_A." in name or ".lora_B." in name:  # PEFT starts lora_B at 0
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return pm


def _trainer(pm: Any, spec: Any, seqs: list[np.ndarray]) -> list[np.ndarray]:
    out = []
    with torch.no_grad(), trainer_numerics(pm, like=spec):
        for s in seqs:
            lp = token_logprobs(pm, torch.from_numpy(s)[None])[0]
            out.append(lp.float().numpy())
    return out


@pytest.mark.parametrize(("transport", "first"), [("http", 20), ("grpc", 30)])
def test_adapters_over_one_base_served_bitwise(
    fresh: Served, model_dir: Path, tmp_path: Path, transport: str, first: int
) -> None:
    a = _peft_model(fresh, model_dir, seed=first, r=4, lora_alpha=8, target_modules=["q_proj"])
    b = _peft_model(
        fresh,
        model_dir,
        seed=first + 1,
        r=2,
        lora_alpha=4,
        use_rslora=True,
        target_modules=["q_proj", "v_proj", "down_proj"],
    )
    b.save_pretrained(tmp_path / "b")
    rng = np.random.default_rng(first)
    seqs = [rng.integers(0, fresh.model.vocab_size, n) for n in (7, 33, 20)]
    with Client(fresh.url(transport), token=WRITE_TOKEN) as c:
        ra = c.publish_adapter(first, a, base_version=BASE)
        rb = c.publish_adapter(first + 1, tmp_path / "b", base_version=BASE)
        assert (ra.created, ra.kind, rb.kind) == (True, "adapter", "adapter")
        assert c.publish_adapter(first, a, base_version=BASE).created is False
        info = c.version(first)
        assert (info.kind, info.adapter_of, info.weight_sha256) == (
            "adapter",
            BASE,
            ra.weight_sha256,
        )
        listed = {v.policy_version: v for v in c.versions()}
        assert listed[first + 1].adapter_of == BASE and listed[BASE].adapter_of is None
        # Both adapters and the bare base in one request: one queue, the base's.
        res = c.logprobs_batch(
            [
                Sequence(token_ids=s, policy_version=v)
                for v in (first, first + 1, BASE)
                for s in seqs
            ],
            use_cache=False,
        )
        spec = c.info().numerics_spec()
        # A trace runs under the adapter too (its stages part from the base's).
        traced, bare = c.trace(seqs[0], first), c.trace(seqs[0], BASE)
        assert traced.weight_sha256 == ra.weight_sha256
        assert [s.sha256 for s in traced.stages] != [s.sha256 for s in bare.stages]
    want_a, want_b = _trainer(a, spec, seqs), _trainer(b, spec, seqs)
    for got, want in zip(res[: len(seqs)], want_a, strict=True):
        assert np.array_equal(got.logprobs[1:], want[1:])
        assert got.weight_sha256[first] == ra.weight_sha256
    for got, want in zip(res[len(seqs) : 2 * len(seqs)], want_b, strict=True):
        assert np.array_equal(got.logprobs[1:], want[1:])
    base = res[2 * len(seqs) :]
    assert not np.array_equal(base[0].logprobs[1:], res[0].logprobs[1:])  # the adapter counts
    # A client without torch reads the directory itself: the same config and hash.
    base_sha = base[0].weight_sha256[BASE]
    assert AdapterUpload.from_directory(tmp_path / "b").sha256(base_sha) == rb.weight_sha256


def test_refusals_by_name(fresh: Served, model_dir: Path, tmp_path: Path, transport: str) -> None:
    first = 40 if transport == "http" else 50
    a = _peft_model(fresh, model_dir, seed=7, r=4, lora_alpha=8, target_modules=["q_proj"])
    other = _peft_model(fresh, model_dir, seed=8, r=4, lora_alpha=8, target_modules=["q_proj"])
    with Client(fresh.url(transport), token=WRITE_TOKEN) as c:
        with pytest.raises(UnknownVersion) as unknown:
            c.publish_adapter(first, a, base_version=9)
        assert unknown.value.parameter == "base_version"
        c.publish_adapter(first, a, base_version=BASE)
        with pytest.raises(InvalidRequest, match="itself an adapter"):
            c.publish_adapter(first + 1, a, base_version=first)
        with pytest.raises(VersionConflict):
            c.publish_adapter(first, other, base_version=BASE)
        with pytest.raises(Conflict, match="base of adapter"):
            c.delete_version(BASE)
    # Server-side checks of a body the client did not make: its config's rank is not the
    # tensors'.
    module = "model.layers.0.self_attn.q_proj"
    wrong = AdapterConfig(8, 16.0, False, (module,), "float32")
    body = tmp_path / "wrong.safetensors"
    save_file(
        {f"{module}.lora_A": torch.zeros(4, 64), f"{module}.lora_B": torch.zeros(64, 4)},
        str(body),
        metadata={ADAPTER_CONFIG_KEY: wrong.to_json()},
    )
    r = httpx.put(
        f"{fresh.server.http_url}/v1/versions/{first + 2}",
        params={"base_version": BASE},
        content=body.read_bytes(),
        headers={"authorization": f"Bearer {WRITE_TOKEN}"},
    )
    assert r.status_code == WeightsMismatch.http_status, r.text
    assert "rank 4" in r.json()["error"]["message"]


def test_cli_publishes_an_adapter_directory(
    fresh: Served, model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from oldlogit_service.cli import main

    pm = _peft_model(fresh, model_dir, seed=60, r=2, lora_alpha=4, target_modules=["k_proj"])
    pm.save_pretrained(tmp_path / "a")
    argv = ["publish", "--url", fresh.server.http_url, "--version", "60", "--token", WRITE_TOKEN]
    assert main([*argv, "--adapter", str(tmp_path / "a")]) == 2  # no --base-version
    assert main([*argv, "--adapter", str(tmp_path / "a"), "--base-version", str(BASE)]) == 0
    assert "version 60 published" in capsys.readouterr().out
    with Client(fresh.server.grpc_url) as c:
        assert c.version(60).adapter_of == BASE


def _tier_bytes(url: str, tier: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(f'oldlogit_tier_bytes{{tier="{tier}"}}'):
            return float(line.split()[-1])
    raise AssertionError(f"no oldlogit_tier_bytes for {tier}")


def test_adapters_in_the_tiers_reload_with_the_same_bits(fresh: Served, model_dir: Path) -> None:
    """An adapter's tensors count in the device tier's bytes (/metrics); evicted with its base,
    both reload and answer the same bits; a cached answer loads neither."""
    a = _peft_model(fresh, model_dir, seed=70, r=4, lora_alpha=8, target_modules=["q_proj"])
    rng = np.random.default_rng(70)
    seqs = [rng.integers(0, fresh.model.vocab_size, n) for n in (9, 25)]
    store = fresh.server.runtime.store  # type: ignore[union-attr]
    url = fresh.server.http_url
    with Client(url, token=WRITE_TOKEN) as c:
        c.publish_adapter(70, a, base_version=BASE)
        asked = [Sequence(token_ids=s, policy_version=70) for s in seqs]
        first = c.logprobs_batch(asked, use_cache=False)
        assert "device" in c.version(70).tiers
        held = _tier_bytes(url, "device")
        assert held == store.stats().tiers["device"].bytes
        assert store.evict(70) and store.evict(BASE)
        assert _tier_bytes(url, "device") == held - store.info(70).nbytes - store.info(BASE).nbytes
        assert "device" not in c.version(70).tiers
        again = c.logprobs_batch(asked, use_cache=True)  # both reloaded; the answers cached
        assert "device" in c.version(70).tiers and "device" in c.version(BASE).tiers
        assert store.evict(70)
        cached = c.logprobs_batch(asked, use_cache=True)
        assert all(r.cached for r in cached) and "device" not in c.version(70).tiers
    for x, y, z in zip(first, again, cached, strict=True):
        assert np.array_equal(x.logprobs, y.logprobs, equal_nan=True)
        assert np.array_equal(x.logprobs, z.logprobs, equal_nan=True)
