"""How each device computes the invariant forward: the kernels, apart from the definition.

``cuda/``: one Triton kernel per file beside the torch op it stands for, and the choice of
GEMM (cuBLASLt where a probe shows its rows invariant, a fixed-tile Triton GEMM otherwise).
Kernels import nothing from the rest of ``oldlogit.parity``; the definition imports them.
"""
