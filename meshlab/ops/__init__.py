"""Fused ops registered as ``torch.library`` custom ops under the ``meshlab::`` namespace.

One op per file, each with a pure-PyTorch reference beside it. Kernels live in ``csrc/``.
"""
