"""Collection settings for the docstring examples (``pytest --doctest-modules meshlab``)."""

import importlib.util

# The Triton kernel files import triton at the top; they are loaded only for CUDA tensors,
# and a CPU-only machine has no triton to import them with.
collect_ignore = [] if importlib.util.find_spec("triton") else [
    "meshlab/ops/_triton.py", "meshlab/ops/_triton_adamw.py"]
