"""The engine against the reference: bitwise in deterministic mode, whatever the batch holds.

Both numerics profiles: ``invariant`` (packed forwards through oldlogit.parity) and ``hf`` (one
unpadded forward per sequence, the head on fixed chunks)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from oldlogit.contract.errors import OutOfMemory
from oldlogit_service.model.engine import Engine, Job, measure_fast_mode_deviation
from oldlogit_service.model.numerics import HEAD_CHUNK_ROWS, SamplingParams
from oldlogit_service.model.reference import reference_logprobs

# Fast-mode bounds: measured max |fast − reference| on these models was ~9e-6 (fp32) and
# ~0.08 (bf16, temperature 0.7); the bounds leave headroom for other CPUs' kernels.
FAST_BOUND = {"float32": 1e-4, "bfloat16": 0.25}

COMBOS = [
    (arch, tie, dtype, numerics)
    for arch in ("qwen2", "llama")
    for tie in (False, True)
    for dtype in ("float32", "bfloat16")
    for numerics in ("invariant", "hf")
]
# invariant: 8 combos × 10 = 80 random batches (each 1–6 jobs); hf: another 80. Under the
# `slow` marker the same combos run 26 cases each (the first 10 are the default run's): 416
# batches, ~30 s more on 2 cores.
CASES_PER_COMBO = 10
CASES_PER_COMBO_SLOW = 26


def _random_sampling(rng: np.random.Generator) -> SamplingParams:
    kind = rng.integers(0, 5)
    if kind == 0:
        return SamplingParams()
    return SamplingParams(
        temperature=float(rng.choice([1.0, 0.7, 1.3, 0.05])),
        top_k=int(rng.choice([0, 1, 5, 50, 511, 512, 1000])) if kind in (2, 4) else 0,
        top_p=float(rng.choice([1.0, 0.9, 0.5, 0.01])) if kind in (3, 4) else 1.0,
    )


def _random_length(rng: np.random.Generator) -> int:
    # Mostly short, with a tail past the production head chunk (256 rows).
    return int(rng.integers(2, 40)) if rng.random() < 0.6 else int(rng.integers(40, 301))


def _random_positions(rng: np.random.Generator, n: int) -> torch.Tensor:
    kind = rng.integers(0, 4)
    if kind == 0:
        pos = np.arange(1, n)  # everything
    elif kind == 1:
        pos = np.arange(int(rng.integers(1, n)), n)  # a score_from suffix
    elif kind == 2:
        pos = np.flatnonzero(rng.random(n) < 0.3)  # scattered
        pos = pos[pos >= 1]
    else:
        pos = np.array([n - 1])  # only the last token
    return torch.from_numpy(pos.astype(np.int64))


@pytest.mark.parametrize(
    "cases",
    [CASES_PER_COMBO, pytest.param(CASES_PER_COMBO_SLOW, marks=pytest.mark.slow)],
    ids=[f"{CASES_PER_COMBO}cases", f"{CASES_PER_COMBO_SLOW}cases"],
)
@pytest.mark.parametrize(("arch", "tie", "dtype", "numerics"), COMBOS)
def test_deterministic_is_bitwise_reference_whatever_the_batch(
    tiny_loaded_factory, arch, tie, dtype, numerics, cases
):
    model, weights = tiny_loaded_factory(
        arch=arch, tie_word_embeddings=tie, dtype=dtype, numerics=numerics
    )
    rng = np.random.default_rng(COMBOS.index((arch, tie, dtype, numerics)))  # per combo
    pool: list[torch.Tensor] = []  # sequences reused across batches and inside one batch
    checked = 0
    for case in range(cases):
        lm_head_fp32 = bool(rng.integers(0, 2))
        # The production chunk size most of the time; small ones to cross chunk edges often.
        chunk = int(rng.choice([HEAD_CHUNK_ROWS, HEAD_CHUNK_ROWS, 32, 7]))
        jobs = []
        for _ in range(int(rng.integers(1, 7))):
            if pool and rng.random() < 0.3:
                ids = pool[int(rng.integers(0, len(pool)))]
            else:
                ids = torch.from_numpy(
                    rng.integers(0, model.vocab_size, _random_length(rng)).astype(np.int64)
                )
                pool.append(ids)
            jobs.append(Job(ids, _random_positions(rng, len(ids)), _random_sampling(rng)))
        engine = Engine(model, lm_head_fp32=lm_head_fp32, head_chunk_rows=chunk)
        # Small head chunks (invariant profile) so multi-chunk heads are exercised too.
        engine.head_rows = int(rng.choice([engine.head_rows, 37, 5]))
        outs = engine.run(weights, jobs)
        assert len(outs) == len(jobs)
        for job, out in zip(jobs, outs, strict=True):
            expected = reference_logprobs(
                model,
                weights,
                job.token_ids,
                job.sampling,
                lm_head_fp32=lm_head_fp32,
                head_chunk_rows=chunk,
            )[job.positions.numpy()]
            assert out.dtype == torch.float32 and out.device.type == "cpu"
            assert not torch.isnan(out).any()
            assert np.array_equal(out.numpy(), expected), (case, job.sampling, chunk, lm_head_fp32)
            checked += 1
        # The same jobs in another composition (reversed, alone) give the same bits.
        alone = engine.run(weights, [jobs[-1]])[0]
        assert torch.equal(alone, outs[-1])
        again = engine.run(weights, list(reversed(jobs)))
        for a, b in zip(reversed(again), outs, strict=True):
            assert torch.equal(a, b)
    assert checked >= cases


def test_identical_sequences_share_one_forward(tiny_loaded_factory, monkeypatch):
    """hf: one forward per distinct sequence; invariant: one packed forward of both."""
    a = torch.arange(2, 52, dtype=torch.int64)
    b = torch.arange(5, 25, dtype=torch.int64)
    jobs = [
        Job(a, torch.tensor([1, 2, 3])),
        Job(b, torch.tensor([19])),
        Job(a.clone(), torch.tensor([3, 49]), SamplingParams(top_k=5)),
    ]
    for numerics, expected in (("hf", [(1, 20), (1, 50)]), ("invariant", [(1, 70)])):
        model, weights = tiny_loaded_factory(numerics=numerics)
        calls: list[tuple[int, ...]] = []
        decoder = model.module.get_decoder()

        def hook(m: torch.nn.Module, _a: object, kw: dict, calls: list = calls) -> None:
            stand_in = getattr(m.__dict__.get("forward"), "__qualname__", "")
            if not stand_in.endswith("<locals>.answer"):  # not the head path's stand-in decoder
                calls.append(tuple(kw["input_ids"].shape))

        handle = decoder.register_forward_pre_hook(hook, with_kwargs=True)
        try:
            outs = Engine(model).run(weights, jobs)
        finally:
            handle.remove()
        assert sorted(calls) == expected, numerics
        assert torch.equal(outs[0], torch.from_numpy(reference_logprobs(model, weights, a)[1:4]))
        top5 = reference_logprobs(model, weights, a, SamplingParams(top_k=5))
        assert torch.equal(outs[2], torch.from_numpy(top5[[3, 49]]))
        ref_b = reference_logprobs(model, weights, b)
        assert torch.equal(outs[1], torch.from_numpy(ref_b[[19]]))


def test_packed_forwards_respect_the_token_budget(tiny_loaded_factory):
    model, weights = tiny_loaded_factory()
    rng = np.random.default_rng(3)
    jobs = []
    for n in (30, 45, 10, 61, 2, 33):
        ids = torch.from_numpy(rng.integers(0, model.vocab_size, n).astype(np.int64))
        jobs.append(Job(ids, torch.arange(1, n)))
    calls: list[int] = []
    decoder = model.module.get_decoder()
    handle = decoder.register_forward_pre_hook(
        lambda _m, _a, kw: calls.append(int(kw["input_ids"].shape[1])), with_kwargs=True
    )
    try:
        outs = Engine(model, max_batch_tokens=64).run(weights, jobs)
    finally:
        handle.remove()
    assert calls == [30, 55, 63, 33]  # in order, ≤ 64 tokens each
    for job, out in zip(jobs, outs, strict=True):
        ref = reference_logprobs(model, weights, job.token_ids)[job.positions.numpy()]
        assert np.array_equal(out.numpy(), ref)


def test_cpu_forwards_are_cache_sized_blocks_of_the_batch(tiny_loaded_factory, monkeypatch):
    """On CPU a batch runs as forwards of at most ``forward_tokens`` tokens (the widest
    activation within ``CPU_FORWARD_BYTES``), a whole number of tiles, with the bits of one
    forward over the whole batch."""
    from oldlogit_service.model import engine as engine_mod

    model, weights = tiny_loaded_factory()
    assert (
        engine_mod.cpu_forward_tokens(
            {"hidden_size": 256, "intermediate_size": 768}, torch.float32, 64
        )
        == 4096
    )
    assert (
        engine_mod.cpu_forward_tokens(  # a multimodal config's text model; never below 512
            {"text_config": {"hidden_size": 4096, "intermediate_size": 14336}}, torch.bfloat16, 64
        )
        == 512
    )
    rng = np.random.default_rng(5)
    jobs = []
    for n in (300, 41, 250, 200, 77, 512):
        ids = torch.from_numpy(rng.integers(0, model.vocab_size, n).astype(np.int64))
        jobs.append(Job(ids, torch.arange(1, n)))
    whole = Engine(model, max_batch_tokens=4096)
    assert whole.forward_tokens == min(
        4096, engine_mod.cpu_forward_tokens(model.config, model.dtype, model.tile_rows or 0)
    )
    whole.forward_tokens = 4096  # one forward of everything
    monkeypatch.setattr(
        engine_mod, "CPU_FORWARD_BYTES", 600 * 4 * model.config["intermediate_size"]
    )
    blocked = Engine(model, max_batch_tokens=4096)
    assert blocked.forward_tokens == 576  # 600 rounded down to whole 64-row tiles
    calls: list[int] = []
    decoder = model.module.get_decoder()
    handle = decoder.register_forward_pre_hook(
        lambda _m, _a, kw: calls.append(int(kw["input_ids"].shape[1])), with_kwargs=True
    )
    try:
        outs = blocked.run(weights, jobs)
        assert calls == [341, 527, 512]  # in order, ≤ 576 tokens each
        calls.clear()
        ref = whole.run(weights, jobs)
        assert calls == [1380]
    finally:
        handle.remove()
    for a, b in zip(outs, ref, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("numerics", ["invariant", "hf"])
def test_empty_inputs(tiny_loaded_factory, numerics):
    tiny_model, tiny_weights = tiny_loaded_factory(numerics=numerics)
    engine = Engine(tiny_model)
    assert engine.run(tiny_weights, []) == []
    (out,) = engine.run(
        tiny_weights, [Job(torch.tensor([1, 2, 3]), torch.empty(0, dtype=torch.int64))]
    )
    assert out.shape == (0,) and out.dtype == torch.float32
    for mode in ("deterministic", "fast"):
        outs = Engine(tiny_model, mode=mode).run(
            tiny_weights,
            [
                Job(torch.tensor([1, 2, 3]), torch.empty(0, dtype=torch.int64)),
                Job(torch.tensor([4, 5]), torch.tensor([1])),
            ],
        )
        assert [o.shape[0] for o in outs] == [0, 1]


@pytest.mark.parametrize(
    ("positions", "match"),
    [
        ([0, 1], r"\[1, 5\)"),
        ([1, 5], r"\[1, 5\)"),
        ([2, 1], "sorted"),
        ([1, 1], "sorted"),
    ],
)
def test_bad_positions_are_refused(tiny_model, tiny_weights, positions, match):
    job = Job(torch.arange(5, dtype=torch.int64), torch.tensor(positions, dtype=torch.int64))
    with pytest.raises(ValueError, match=match):
        Engine(tiny_model).run(tiny_weights, [job])


def test_bad_engine_arguments(tiny_model):
    with pytest.raises(ValueError):
        Engine(tiny_model, mode="sloppy")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        Engine(tiny_model, head_chunk_rows=0)


@pytest.mark.parametrize(
    "exc",
    [
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried... out of memory"),
    ],
)
def test_out_of_memory_is_mapped(tiny_model, tiny_weights, monkeypatch, exc):
    def boom(*args, **kwargs):
        raise exc

    monkeypatch.setattr("oldlogit_service.model.engine.row_logits", boom)
    with pytest.raises(OutOfMemory) as info:
        Engine(tiny_model).run(tiny_weights, [Job(torch.tensor([1, 2]), torch.tensor([1]))])
    assert info.value.__cause__ is exc
    assert info.value.http_status == 507


def test_other_runtime_errors_pass_through(tiny_model, tiny_weights, monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("shape mismatch")

    monkeypatch.setattr("oldlogit_service.model.engine.row_logits", boom)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        Engine(tiny_model).run(tiny_weights, [Job(torch.tensor([1, 2]), torch.tensor([1]))])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("lm_head_fp32", [False, True])
def test_fast_mode_within_measured_bound(tiny_loaded_factory, dtype, lm_head_fp32):
    model, weights = tiny_loaded_factory(
        arch="llama", tie_word_embeddings=True, dtype=dtype, numerics="hf"
    )
    worst = measure_fast_mode_deviation(
        model,
        weights,
        num_sequences=12,
        sampling=SamplingParams(temperature=0.7),
        lm_head_fp32=lm_head_fp32,
        max_batch_tokens=1200,  # several padded forwards of mixed lengths
        seed=7,
    )
    assert 0.0 <= worst <= FAST_BOUND[dtype]


def test_fast_mode_keeps_job_order_and_positions(tiny_loaded_factory):
    tiny_model, tiny_weights = tiny_loaded_factory(numerics="hf")
    rng = np.random.default_rng(8)
    jobs = []
    for n in (300, 3, 120, 3, 57):
        ids = torch.from_numpy(rng.integers(0, tiny_model.vocab_size, n).astype(np.int64))
        jobs.append(Job(ids, _random_positions(rng, n), SamplingParams(temperature=0.9)))
    outs = Engine(tiny_model, mode="fast", max_batch_tokens=400).run(tiny_weights, jobs)
    for job, out in zip(jobs, outs, strict=True):
        ref = reference_logprobs(tiny_model, tiny_weights, job.token_ids, job.sampling)
        assert out.shape == job.positions.shape
        np.testing.assert_allclose(out.numpy(), ref[job.positions.numpy()], rtol=0, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("numerics", ["invariant", "hf"])
def test_deterministic_is_bitwise_reference_on_cuda(tiny_loaded_factory, dtype, numerics):
    model, weights = tiny_loaded_factory(dtype=dtype, device="cuda", numerics=numerics)
    weights = {k: v.to(model.device) for k, v in weights.items()}
    rng = np.random.default_rng(9)
    for _ in range(20):
        jobs = []
        for _ in range(int(rng.integers(1, 4))):
            n = _random_length(rng)
            ids = torch.from_numpy(rng.integers(0, model.vocab_size, n).astype(np.int64))
            jobs.append(Job(ids, _random_positions(rng, n), _random_sampling(rng)))
        outs = Engine(model).run(weights, jobs)
        for job, out in zip(jobs, outs, strict=True):
            ref = reference_logprobs(model, weights, job.token_ids, job.sampling)
            assert out.device.type == "cpu"
            assert np.array_equal(out.numpy(), ref[job.positions.numpy()])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_real_cuda_out_of_memory_is_a_clean_error_and_the_engine_goes_on(tiny_loaded_factory):
    """The caching allocator's own failure (the process held to its weights and 32 MiB more),
    not a simulated one: the batch fails with ``OutOfMemory``, the cache is released, and the
    next batch on the same engine is served with the reference's bits."""
    model, weights = tiny_loaded_factory(dtype="float32", device="cuda")
    weights = {k: v.to(model.device) for k, v in weights.items()}
    rng = np.random.default_rng(11)
    ids = torch.from_numpy(rng.integers(0, model.vocab_size, 40).astype(np.int64))
    small = Job(ids, torch.arange(1, 40), SamplingParams())
    engine = Engine(model, max_batch_tokens=1 << 20)
    want = reference_logprobs(model, weights, ids)[1:]
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + (32 << 20)) / total)
    try:
        big = [
            Job(
                torch.from_numpy(rng.integers(0, model.vocab_size, 250).astype(np.int64)),
                torch.arange(1, 250),
                SamplingParams(),
            )
            for _ in range(2000)
        ]  # 500,000 tokens in one batch
        with pytest.raises(OutOfMemory) as info:
            engine.run(weights, big)
        assert isinstance(info.value.__cause__, torch.OutOfMemoryError)
        assert info.value.http_status == 507
        got = engine.run(weights, [small])[0]
        assert np.array_equal(got.numpy(), want)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
