"""The CUDA definition's kernels: row-invariant by construction, one Triton kernel per file.

Each file opens with the torch op it replaces and the property it guarantees, holds its launch
wrapper, and has its test under ``TRITON_INTERPRET=1`` in tests/unit. Triton is imported by
these modules only, so a CPU-only install never needs it.
"""
