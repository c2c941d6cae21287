"""The client's machinery for reaching a deployment: transports, replicas, retries, TLS, a loop.

Owns the ``Transport`` protocol and its two implementations (``http`` over httpx, ``grpc`` over
grpc.aio), picked by URL scheme (``base.open_transport``); the replicas of a deployment as the
client calls them (``pool``), with the one retry mechanism and the replica ranking (``retry``);
the client's TLS options and handshake diagnosis (``tls``); the private event loop the blocking
``Client`` runs on (``loop_thread``).

May import the contract (``oldlogit.contract``), httpx, grpc and the generated protobuf code.
Never the publishing part, the parity or correction code, nor torch. Transports speak contract
types and raise the contract's errors; nothing above them sees httpx or a ``pb2`` message.
Importing this package imports none of its modules.
"""
