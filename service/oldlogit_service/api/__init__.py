"""The transports: HTTP (FastAPI) and gRPC translate bytes to contract types and back.

Owns ``http`` (routes, the auth gate, one error handler), ``sessions_http`` (the multi-rank
publish session routes), ``grpc`` (the servicer, auth and error interceptor, health,
reflection), ``status_page`` (the HTML status page), ``auth`` (which token a call needs, and
the check) and ``tls`` (server certificates for both ports, reloaded in place).

May import the runtime, ``metrics``, ``history`` and the client's contract and codecs; holds no
logic of its own beyond translation, and never decides what blocks.
"""
