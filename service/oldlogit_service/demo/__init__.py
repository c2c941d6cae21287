"""Offline models and the demo deployment: no hub, no network, no GPU.

Owns ``tiny`` (a seeded random causal LM written to disk as config.json + safetensors, used by
the demo, the tests and the benchmarks) and ``deployment`` (``oldlogit serve --demo``: a tiny
model and a few published versions). Never on the serving path of a real deployment.

May import the model zone and ``snapshots``; nothing above them.
"""
