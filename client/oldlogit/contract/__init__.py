"""The contract: what the client and the service both hold to, written once for both sides.

Owns the request and response types (``types``), the error tree (``errors``), the HTTP bodies
(``wire``) and the protobuf conversions (``convert``), MoE routing records (``routing``: their
rules, vLLM's and SGLang's layouts), the gRPC channel options
(``grpc_options``), the numerics a forward depends on (``numerics``), and what both sides
share about weights: the weight hash, safetensors headers and dtypes (``weights``), the layout
of names (``layout``), the delta encoding (``delta``) and the safetensors stream writer
(``safetensors``).

May import numpy, pydantic, msgpack, protobuf (the generated code in ``oldlogit._proto``) and
grpc's status codes. Never torch at import time (``weights`` and ``safetensors`` import it inside
the functions that cast a torch tensor), and never the client, transport or publishing parts:
the service imports this package, so whatever it imports the service runs. Importing this
package imports none of its modules.
"""
