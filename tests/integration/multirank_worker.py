"""One rank of tests/integration/test_multirank_publish.py (run as a process per rank).

``python -m tests.integration.multirank_worker RANK WORLD INIT_FILE URL OUT_JSON``: joins a gloo
group, builds the seeded test model, shards it with FSDP2 (``fully_shard``, CPU) and publishes
from every rank: v1 full (streamed), v2 a delta, v3 with every rank sending its own plain share,
v4 where rank 1 cannot reach the service (every rank must raise, nothing visible). Writes what
it saw to OUT_JSON. (A plain ``Client.publish`` of the sharded state dict is refused first.)
"""

from __future__ import annotations

import json
import sys
import traceback

import torch
import torch.distributed as dist

from oldlogit import Client, OldLogitError
from oldlogit.integrations import ShardedPublisher, publish_sharded
from tests.architectures import hf_model
from tests.integration.conftest import WRITE_TOKEN

ARCH = "qwen3_moe"


def nudge_(tensor: torch.Tensor) -> None:
    """An optimizer-like step on some elements: elementwise, so the same on a shard as on the
    whole tensor."""
    tensor.add_(torch.where(tensor > 0.4, 2.0**-9, 0.0))


def main(rank: int, world: int, init_file: str, url: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    seen: dict[str, object] = {"rank": rank}
    try:
        model = hf_model(ARCH, seed=11)
        mesh = init_device_mesh("cpu", (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        state = model.state_dict()
        seen["dtensors"] = sum(type(v).__name__ == "DTensor" for v in state.values())
        with Client(url, token=WRITE_TOKEN, timeout_s=120) as client:
            try:  # a plain publish cannot gather alone: it says what to call instead
                client.publish(9, state)
            except OldLogitError as exc:
                seen["plain"] = f"{exc.parameter}: {exc.message}"
            seen["v1"] = publish_sharded(client, 1, state).weight_sha256
            publisher = ShardedPublisher(client)
            seen["v2_full"] = publisher.publish(2, state).weight_sha256
            with torch.no_grad():
                for p in model.parameters():
                    nudge_(p)
            res = publisher.publish(3, model.state_dict(), delta=True)
            seen["v3"], seen["v3_kind"] = res.weight_sha256, res.kind
            # Every rank sends its own plain share (a pipeline-style split of the names).
            full = {k: v.full_tensor() for k, v in model.state_dict().items()}
            share = {k: v for i, (k, v) in enumerate(sorted(full.items())) if i % world == rank}
            seen["v4"] = ShardedPublisher(client, deltas=False).publish(4, share).weight_sha256
        # Rank 1 cannot reach the service: every rank raises, nothing is published.
        bad_url = "grpc://127.0.0.1:1" if rank == 1 else url
        with Client(bad_url, token=WRITE_TOKEN, timeout_s=20, retries=0) as client:
            try:
                publish_sharded(client, 5, model.state_dict())
                seen["v5"] = "published"
            except OldLogitError as exc:
                seen["v5"] = f"{exc.code}: {exc.message}"
    except BaseException:
        seen["error"] = traceback.format_exc()
    finally:
        with open(out, "w") as f:
            json.dump(seen, f)
        dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5])
