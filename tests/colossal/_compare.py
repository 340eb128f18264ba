"""The exact comparison of nested state the Colossal-AI cases use (where Colossal-AI's
``check_state_dict_equal`` allows 1e-3)."""

from __future__ import annotations

import torch


def equal_state(a, b) -> None:
    """Nested state dicts equal exactly: a tuple stays a tuple, a tensor keeps its dtype
    (a dict may come back as an OrderedDict, as torch.load gives it)."""
    assert isinstance(a, dict) == isinstance(b, dict) and (isinstance(a, dict) or
                                                          type(a) is type(b)), (a, b)
    if isinstance(a, dict):
        assert a.keys() == b.keys(), (list(a), list(b))
        for k in a:
            equal_state(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            equal_state(x, y)
    elif torch.is_tensor(a):
        assert a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu()), (a, b)
    else:
        assert a == b, (a, b)
