"""The gRPC channel options both ends of a connection agree on: message sizes and keepalive.

In: nothing; out: option tuples for ``grpc.aio`` — ``CHANNEL_OPTIONS`` for the client's
channels (``oldlogit.transport.grpc``), ``SERVER_OPTIONS`` for the service's server. Plain
constants: this module imports no grpc and opens nothing.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CHANNEL_OPTIONS", "MAX_MESSAGE_BYTES", "SERVER_OPTIONS"]

# Logprobs of large batches and publish chunks are far above gRPC's 4 MiB default.
MAX_MESSAGE_BYTES = 256 * 1024 * 1024

CHANNEL_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # Ping during calls so a dead peer (a killed replica) is noticed in ~80 s instead of the
    # OS TCP timeout; only while calls are active, as servers refuse idle pings by default.
    ("grpc.keepalive_time_ms", 60_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.keepalive_permit_without_calls", 0),
    ("grpc.http2.max_pings_without_data", 0),  # a long forward sends no data for a while
    ("grpc.enable_retries", 0),  # one retry mechanism: oldlogit.transport.retry
)

# For the server: the same sizes, and it accepts the client's pings during calls.
SERVER_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 60_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 30_000),
    ("grpc.http2.max_ping_strikes", 0),
)
