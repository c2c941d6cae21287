"""The service's one configuration object.

Built once in the CLI (flags override ``OLDLOGIT_*`` environment variables) and passed down;
nothing else reads the environment. Validators refuse bad combinations at start-up with a
sentence that says what to change.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from oldlogit.contract.numerics import DEFAULT_TP_CHUNKS
from oldlogit.parity import DEFAULT_TILE_ROWS

GIB = 1024**3
MIB = 1024**2


def is_wildcard(host: str) -> bool:
    """True for the "every interface" bind addresses (0.0.0.0, ::, ''): never reachable."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return host.strip("[]") == ""


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="OLDLOGIT_", frozen=True, extra="forbid")

    # What to serve.
    model: Path | None = None  # HF-format model directory (config.json + safetensors)
    demo: bool = False  # build a tiny random causal LM and publish a few versions
    snapshot_dir: Path = Path("./snapshots")
    # Where.
    host: str = "127.0.0.1"
    http_port: int = Field(8000, ge=0, le=65535)
    grpc_port: int = Field(50051, ge=0, le=65535)
    # The host other replicas' clients reach this one at (published in the membership); None:
    # the bind address if it is a specific one, else this machine's hostname (cluster.py).
    advertise_host: str | None = Field(None, min_length=1)
    # Numerics.
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    lm_head_fp32: bool = False
    mode: Literal["deterministic", "fast"] = "deterministic"
    # invariant: one batch-invariant forward shared with trainers (oldlogit.parity), packed
    # batches; hf: the unpatched transformers forward of each sequence alone.
    numerics: Literal["invariant", "hf"] = "invariant"
    tile_rows: int = Field(DEFAULT_TILE_ROWS, ge=1, le=4096)  # rows per GEMM tile (invariant)
    # The tensor-parallel definition (invariant only): row-parallel sums and the head's
    # log-softmax in this many float32 chunks, the same bits at any tensor-parallel degree
    # dividing it (docs/exactness.md, "Tensor parallelism"); 0: the single-device definition.
    tp_chunks: int = Field(0, ge=0, le=1024)
    # One replica over this many ranks (torch.distributed; gloo on CPU, NCCL on CUDA), each
    # holding 1/N of every resident version; needs tp_chunks > 0 (8 when not given). Rank 0
    # serves HTTP/gRPC and starts the others (docs/operations.md, "Tensor parallel serving").
    tensor_parallel: int = Field(1, ge=1, le=64)
    # How long a rank may take to join at start-up, and the longest a collective may wait.
    rank_timeout_s: float = Field(120.0, gt=0)
    # Retention.
    # None: on a GPU, free device memory at start-up minus activation_headroom_gib (the
    # forward's activations need room too); on CPU, 4 GiB.
    device_budget_gib: float | None = Field(None, gt=0)
    activation_headroom_gib: float = Field(2.0, ge=0)
    host_budget_gib: float = Field(8.0, ge=0)
    disk_budget_gib: float = Field(100.0, gt=0)
    max_versions: int = Field(64, ge=1)
    # Delta snapshots: a version is a patch against its parent unless its chain would reach
    # keyframe_every versions or its patches keyframe_chain_fraction of a keyframe (1 = every
    # version a keyframe). Both bound what rebuilding a version reads and applies.
    keyframe_every: int = Field(16, ge=1)
    keyframe_chain_fraction: float = Field(0.5, gt=0)
    # The sweeper moves a keyframe down its chain to where rebuilds are asked for (the same
    # bytes on disk, shorter chains for the hot versions: docs/delta-snapshots.md); False: a
    # keyframe stays where the policy put it at publish (--fixed-keyframes).
    keyframes_follow_access: bool = True
    # snapshot: random access to any retained version; lagging: one resident model advanced
    # version by version, requests served in version order (passed versions: snapshot path).
    strategy: Literal["snapshot", "lagging"] = "snapshot"
    # Scale-out (docs/operations.md, "Scale-out").
    redis_url: str | None = None
    cache_redis_url: str | None = None
    namespace: str = Field("default", pattern=r"^[A-Za-z0-9_.-]{1,64}$")  # keys per deployment
    replica_id: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]{1,128}$")  # default host-pid
    # Auth.
    # Secrets: never shown by repr() or logs; compared in constant time (runtime.authorize).
    write_token: SecretStr | None = None
    read_token: SecretStr | None = None
    # Transport security (docs/operations.md, "Security"): PEM files for both transports,
    # re-read on SIGHUP and every tls_reload_interval_s (new handshakes get the new certificates).
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    tls_client_ca_file: Path | None = None  # mutual TLS: client certificates signed by this CA
    tls_reload_interval_s: float = Field(30.0, gt=0)
    # A plain-HTTP port that answers /healthz and /readyz only (probes that cannot speak TLS
    # or present a client certificate); None: none.
    health_port: int | None = Field(None, ge=0, le=65535)
    # Batching and limits.
    max_wait_ms: float = Field(2.0, ge=0)
    max_batch_tokens: int = Field(65536, ge=1)
    max_queue: int = Field(4096, ge=1)
    max_seq_len: int | None = Field(None, ge=2)  # default: the model's max positions
    max_tokens_per_request: int = Field(1 << 20, ge=1)
    max_sequences_per_request: int = Field(4096, ge=1)
    max_request_mib: float = Field(256.0, gt=0)
    max_upload_gib: float = Field(64.0, gt=0)
    request_timeout_s: float = Field(300.0, gt=0)
    cache_budget_mib: float = Field(256.0, ge=0)
    publish_roots: list[Path] = Field(default_factory=list)  # publish-by-path allowed under these
    drain_timeout_s: float = Field(30.0, ge=0)
    sweep_interval_s: float = Field(1.0, gt=0)  # lease expiry and disk retention, periodically
    log_level: str = "INFO"
    # Approximate answers (never exact): the EWMA proxy policy's decay; None disables it.
    ewma_beta: float | None = Field(None, gt=0, lt=1)

    @field_validator(
        "tls_cert_file", "tls_key_file", "tls_client_ca_file", "redis_url", mode="before"
    )
    @classmethod
    def _empty_is_unset(cls, value: Any) -> Any:
        # OLDLOGIT_TLS_CLIENT_CA_FILE="" (a compose default) means "not set", not the cwd;
        # OLDLOGIT_REDIS_URL="" unsets the base's registry (deploy/k8s/overlays/gpu-tp).
        return None if value == "" else value

    @model_validator(mode="before")
    @classmethod
    def _tensor_parallel_chunks(cls, data: Any) -> Any:
        # --tensor-parallel N > 1 runs the tensor-parallel definition: tp_chunks 8 unless given.
        if isinstance(data, dict):
            tp = data.get("tensor_parallel", 1)
            if data.get("tp_chunks") is None and str(tp).strip() not in ("", "1"):
                data = {**data, "tp_chunks": DEFAULT_TP_CHUNKS}
        return data

    @model_validator(mode="after")
    def _check(self) -> Settings:
        if self.model is None and not self.demo:
            raise ValueError("set --model DIR (an HF-format model directory) or --demo")
        if self.model is not None and self.demo:
            raise ValueError("--model and --demo exclude each other: choose one")
        if self.advertise_host is not None and is_wildcard(self.advertise_host):
            raise ValueError(
                f"--advertise-host {self.advertise_host} is no address a client can reach: "
                "give this replica's DNS name or IP (compose: the service name; Kubernetes: "
                "the pod IP), or leave it unset"
            )
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError(
                "TLS needs both --tls-cert-file (the PEM chain) and --tls-key-file (its key)"
            )
        if self.health_port and self.health_port in (self.http_port, self.grpc_port):
            raise ValueError(
                f"--health-port {self.health_port} is also the HTTP or gRPC port: pick another"
            )
        if self.tls_client_ca_file is not None and self.tls_cert_file is None:
            raise ValueError(
                "--tls-client-ca-file (mutual TLS) needs --tls-cert-file and --tls-key-file"
            )
        if self.tensor_parallel > 1:
            self._check_tensor_parallel()
        if self.tp_chunks and self.numerics != "invariant":
            raise ValueError(
                f"--tp-chunks {self.tp_chunks} is a definition of the invariant numerics: "
                "it needs --numerics invariant"
            )
        if self.dtype == "float16" and self.device == "cpu":
            raise ValueError(
                "float16 on CPU is slow and poorly supported: use --dtype bfloat16 or float32"
            )
        return self

    def _check_tensor_parallel(self) -> None:
        n = self.tensor_parallel
        if self.numerics != "invariant":
            raise ValueError(
                f"--tensor-parallel {n} runs the tensor-parallel definition of the invariant "
                f"numerics: --numerics {self.numerics} cannot be split over ranks"
            )
        if self.tp_chunks == 0:
            raise ValueError(
                f"--tensor-parallel {n} needs --tp-chunks > 0 (the definition that gives the same "
                "bits at every degree; leave it unset for 8)"
            )
        refused = {
            "--redis-url (scale-out)": self.redis_url is not None,
            "--strategy lagging": self.strategy == "lagging",
            "--ewma-beta": self.ewma_beta is not None,
        }
        for flag, given in refused.items():
            if given:
                raise ValueError(f"{flag} is not served with --tensor-parallel {n}: drop one")

    def device_budget_bytes(self, device: Any) -> int:
        """The device tier's budget on ``device`` (a ``torch.device``; see the setting)."""
        if self.device_budget_gib is not None:
            return int(self.device_budget_gib * GIB)
        if getattr(device, "type", "cpu") == "cuda":
            import torch

            free, _total = torch.cuda.mem_get_info(device)
            return max(0, int(free - self.activation_headroom_gib * GIB))
        return 4 * GIB

    @property
    def tls_enabled(self) -> bool:
        return self.tls_cert_file is not None

    @property
    def host_budget_bytes(self) -> int:
        return int(self.host_budget_gib * GIB)

    @property
    def disk_budget_bytes(self) -> int:
        return int(self.disk_budget_gib * GIB)

    @property
    def cache_budget_bytes(self) -> int:
        return int(self.cache_budget_mib * MIB)
