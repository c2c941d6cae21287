"""Publishing from the trainer side: a trainer's weights become a version on the service.

Owns the ``Publisher`` (``publisher``: what ``Client.publish`` does, and the state it keeps
between calls — the weights last published as a delta, the model's weight layout), a state
dict as canonical tensor sources (``sources``), the streams and copies of weights a publish
uploads (``streams``: ``WeightsCopy``, deltas, progress) and the client side of multi-rank
publish sessions (``sessions``).

May import the contract (``oldlogit.contract``: the stream writer, the delta format, the weight
hash, the layout) and numpy; the transport only for its types (calls come in through the
client's ``TransportPool``). Never torch at import time (tensors are duck-typed), nor the client
module, parity or correction. Importing this package imports none of its modules.
"""
