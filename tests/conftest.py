"""Shared fixtures that build tiny random causal LMs (offline, seeded, cached per session).

- ``tiny_model_factory(**kwargs) -> Path``: a model directory from ``make_tiny_model_dir``
  (same kwargs → same directory).
- ``tiny_loaded_factory(dtype="float32", device="cpu", numerics="invariant", **kwargs)
  -> (LoadedModel, weights)``: ``numerics`` is the profile the skeleton is loaded with.
- ``tiny_model_dir`` / ``tiny_model`` / ``tiny_weights``: the default (qwen2, untied, fp32).
torch is imported lazily so torch-free client tests stay torch-free. Never mutate the weights.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

# Without an NVIDIA driver, Triton kernels (client/oldlogit/parity/kernels/cuda/) run under its
# CPU interpreter; it is read when a kernel is defined, so before any kernel module is imported.
# Checked without torch (a device node or nvidia-smi) so torch-free client tests stay torch-free.
if not (os.path.exists("/dev/nvidiactl") or shutil.which("nvidia-smi")):
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None:
    # Its tl.dot summed in one order for every row, as on a GPU (tests/triton_interpreter.py).
    from tests import triton_interpreter

    triton_interpreter.install()

_FOLDER_MARKERS = ("unit", "integration", "e2e")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Markers by folder (tests/unit → ``unit`` …); ``gpu`` tests skip without CUDA."""
    cuda: bool | None = None
    for item in items:
        parts = item.path.parts
        for name in _FOLDER_MARKERS:
            if name in parts:
                item.add_marker(getattr(pytest.mark, name))
        if item.get_closest_marker("gpu") is not None:
            if cuda is None:
                import torch

                cuda = torch.cuda.is_available()
            if not cuda:
                item.add_marker(pytest.mark.skip(reason="needs CUDA"))


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    from oldlogit_service.demo.tiny import make_tiny_model_dir

    cache: dict[tuple[tuple[str, Any], ...], Path] = {}

    def make(**kwargs: Any) -> Path:
        key = tuple(sorted(kwargs.items()))
        if key not in cache:
            cache[key] = make_tiny_model_dir(tmp_path_factory.mktemp("tiny_model"), **kwargs)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_loaded_factory(tiny_model_factory: Callable[..., Path]) -> Callable[..., tuple[Any, Any]]:
    from oldlogit_service.model.checkpoints import load_weights
    from oldlogit_service.model.loaded import load_model

    cache: dict[tuple[tuple[str, Any], ...], tuple[Any, Any]] = {}

    def load(
        *, dtype: str = "float32", device: str = "cpu", numerics: str = "invariant", **kwargs: Any
    ) -> tuple[Any, Any]:
        key = (
            ("dtype", dtype),
            ("device", device),
            ("numerics", numerics),
            *sorted(kwargs.items()),
        )
        if key not in cache:
            model_dir = tiny_model_factory(**kwargs)
            model = load_model(model_dir, dtype=dtype, device=device, numerics=numerics)
            cache[key] = (model, load_weights(model_dir, model))
        return cache[key]

    return load


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory()


@pytest.fixture(scope="session")
def tiny_model(tiny_loaded_factory: Callable[..., tuple[Any, Any]]) -> Any:
    return tiny_loaded_factory()[0]


@pytest.fixture(scope="session")
def tiny_weights(tiny_loaded_factory: Callable[..., tuple[Any, Any]]) -> Any:
    return tiny_loaded_factory()[1]


@pytest.fixture
def redis_server(tmp_path: Path) -> Any:
    """A real registry Redis (noeviction) for one test."""
    from tests.redis_server import RedisServer

    srv = RedisServer(tmp_path / "redis").start()
    yield srv
    srv.stop()
