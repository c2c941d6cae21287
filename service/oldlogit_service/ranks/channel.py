"""The command protocol between rank 0 (the front) and the other ranks, over torch.distributed.

One ``Channel`` per process group, used by one thread on every rank, so every rank issues the
group's collectives in the same order. The front ``send``s a command (a name and a picklable
payload, broadcast), optionally each rank its own tensors (``send_parts``: raw bytes,
point-to-point); a follower ``receive``s it, does it, and every rank's ``Reply`` comes back
to the front (``replies``: a gather). ``agree`` is the all-ranks check before a forward
(nobody enters the forward's collectives unless every rank has its weights).
Nothing here decides what a command means (``follower.py``, ``front.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from oldlogit.contract.errors import InternalError, OldLogitError, error_from_payload

__all__ = ["Channel", "Reply", "reply_error"]


@dataclass(frozen=True)
class Reply:
    """One rank's answer to a command: a value, or the error it failed with (a payload of the
    error tree, or a foreign exception's one-line description)."""

    value: Any = None
    error: dict[str, Any] | None = None
    failure: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.failure is None

    def raise_for(self, rank: int) -> Any:
        """The value, or the rank's error (an error of the tree as it was; anything else as an
        ``InternalError`` naming the rank)."""
        if self.error is not None:
            raise error_from_payload(self.error)
        if self.failure is not None:
            raise InternalError(f"tensor-parallel rank {rank}: {self.failure}")
        return self.value


def reply_error(exc: BaseException) -> Reply:
    if isinstance(exc, OldLogitError):
        return Reply(error=exc.to_payload())
    return Reply(failure=f"{type(exc).__name__}: {exc}")


class Channel:
    """Commands from rank 0 over ``group``; ``rank``/``degree`` are this process's place."""

    def __init__(self, group: Any, rank: int, degree: int) -> None:
        self.group = group
        self.rank = rank
        self.degree = degree

    # -- both sides -------------------------------------------------------------------------
    def send(self, op: str, payload: Any = None) -> None:
        """Front: broadcast a command to every rank."""
        assert self.rank == 0
        dist.broadcast_object_list([op, payload], src=0, group=self.group)

    def receive(self) -> tuple[str, Any]:
        """Follower: the next command (blocks until the front sends one)."""
        box: list[Any] = [None, None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return str(box[0]), box[1]

    def replies(self, mine: Reply) -> list[Reply]:
        """Every rank's reply, in rank order, at the front (followers get an empty list)."""
        out: list[Any] | None = [None] * self.degree if self.rank == 0 else None
        dist.gather_object(mine, out, dst=0, group=self.group)
        return [r if isinstance(r, Reply) else Reply(failure="no reply") for r in out or []]

    def agree(self, mine: Reply) -> list[Reply]:
        """Every rank's reply on every rank (a forward starts only if all are ok)."""
        out: list[Any] = [None] * self.degree
        dist.all_gather_object(out, mine, group=self.group)
        return [r if isinstance(r, Reply) else Reply(failure="no reply") for r in out]

    # -- tensors ----------------------------------------------------------------------------
    def send_parts(self, parts: list[Mapping[str, Tensor]]) -> None:
        """Front: each follower rank its own tensors (``parts[rank]``), by name in sorted
        order, as raw bytes; the follower knows their specs (``receive_parts``)."""
        for rank in range(1, self.degree):
            for name in sorted(parts[rank]):
                t = parts[rank][name].contiguous()
                dist.send(t.view(torch.uint8).reshape(-1), dst=rank, group=self.group)

    def receive_parts(
        self, specs: Mapping[str, tuple[torch.dtype, tuple[int, ...]]]
    ) -> dict[str, Tensor]:
        """Follower: this rank's tensors, in ``specs``' shapes and dtypes."""
        out: dict[str, Tensor] = {}
        for name in sorted(specs):
            dtype, shape = specs[name]
            t = torch.empty(shape, dtype=dtype)
            dist.recv(t.view(torch.uint8).reshape(-1), src=0, group=self.group)
            out[name] = t
        return out
