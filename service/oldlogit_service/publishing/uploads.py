"""Where a publish's bytes come from: an upload stream, or a path under a publish root.

In: an upload's chunks (HTTP body or gRPC stream) and the byte limit; or a path a caller names
and the configured publish roots. Out: the bytes in a staging file (written in worker threads,
batched, so the event loop never writes); or the path resolved (symlinks followed) and checked
to lie under a root. Refusals are errors of the tree naming the parameter. Knows nothing of
versions or the store.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

from oldlogit.contract.errors import Forbidden, InvalidRequest, LimitExceeded

__all__ = ["MAX_PATH_CHARS", "receive_upload", "resolve_publish_path"]

# Upload bytes gathered before one write in a worker thread (the event loop never writes).
FLUSH_BYTES = 8 * 1024 * 1024
MAX_PATH_CHARS = 4096


async def receive_upload(
    chunks: AsyncIterator[bytes], path: Path, *, limit_bytes: int, parameter: str
) -> None:
    """Stream an upload to ``path`` within ``limit_bytes``; an empty upload is refused."""
    size = 0
    with open(path, "wb") as f:
        batch: list[bytes] = []
        held = 0
        async for chunk in chunks:
            size += len(chunk)
            if size > limit_bytes:
                raise LimitExceeded(
                    f"the upload exceeds the limit of {limit_bytes} bytes", parameter=parameter
                )
            batch.append(chunk)
            held += len(chunk)
            if held >= FLUSH_BYTES:
                await asyncio.to_thread(f.writelines, batch)
                batch, held = [], 0
        if batch:
            await asyncio.to_thread(f.writelines, batch)
    if size == 0:
        raise InvalidRequest("the upload is empty: send a safetensors file", parameter=parameter)


def resolve_publish_path(path: str, roots: Sequence[Path]) -> Path:
    """``path`` resolved, if it names an existing file or directory under one of ``roots``
    (blocking: it touches the file system). No roots configured means publish by path is off."""
    resolved_roots = [r.resolve() for r in roots]
    if not resolved_roots:
        raise Forbidden(
            "publish by path is disabled: start the service with --publish-root DIR",
            parameter="path",
        )
    if not path or "\x00" in path or len(path) > MAX_PATH_CHARS:
        raise InvalidRequest(
            f"path must be a non-empty file system path (no NUL bytes, at most "
            f"{MAX_PATH_CHARS} chars)",
            parameter="path",
        )
    try:
        target = Path(path).resolve()  # symlinks resolved: no escaping a root via a link
    except (OSError, ValueError, RuntimeError) as exc:
        raise InvalidRequest(f"path {path!r} cannot be resolved: {exc}", parameter="path") from exc
    if not any(target == r or target.is_relative_to(r) for r in resolved_roots):
        raise Forbidden(f"path {path!r} is not under a configured publish root", parameter="path")
    if not target.exists():
        raise InvalidRequest(f"path {path!r} does not exist", parameter="path")
    return target
