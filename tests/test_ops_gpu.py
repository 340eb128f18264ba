"""The fused ops' Triton kernels on a CUDA device: the Triton path is taken, outputs and
gradients match the reference in float32 and bfloat16, and opcheck passes."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

OPS = ("rms_norm", "rotary", "swiglu", "layer_norm", "linear_cross_entropy")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("op", OPS)
def test_triton_matches_reference(op, dtype):
    pytest.importorskip("triton")
    from meshlab import _check
    from meshlab.ops import _build

    row = _check.check_op(op, "cuda", dtypes=(dtype,), run_opcheck=False)
    assert row.native, row.reason
    assert _build.LAST_PATH[(op, "cuda")].reason.startswith("Triton"), _build.LAST_PATH
    assert not row.failures, row.failures


@pytest.mark.parametrize("op", OPS)
def test_opcheck_cuda(op):
    pytest.importorskip("triton")
    from meshlab import _check

    row = _check.check_op(op, "cuda", dtypes=("bfloat16",), run_opcheck=True, small=True)
    assert not row.failures, row.failures


@pytest.mark.parametrize("tokens", [1, 7, 4099])
def test_norm_backward_bands(tokens):
    """Weight gradients are summed in bands of rows; odd row counts must lose none."""
    pytest.importorskip("triton")
    from meshlab.ops import layer_norm, layer_norm_reference, rms_norm, rms_norm_reference

    x = torch.randn(tokens, 4096, device="cuda", requires_grad=True)
    w = torch.randn(4096, device="cuda", requires_grad=True)
    b = torch.randn(4096, device="cuda", requires_grad=True)
    for fn, ref, args in ((rms_norm, rms_norm_reference, (x, w)),
                          (layer_norm, layer_norm_reference, (x, w, b))):
        g = torch.randn(tokens, 4096, device="cuda")
        got = torch.autograd.grad(fn(*args), args, g)
        want = torch.autograd.grad(ref(*args), args, g)
        for a, e in zip(got, want):
            torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-4)
