"""What the ranks agree on beyond shapes: the batch a step reads, the optimizer's
hyper-parameters, and the replicas' parameters.

Shapes that differ hang or raise; contents that differ train silently wrong: tensor-
parallel peers fed other tokens compute one layer from two batches, a rank at another
learning rate moves its replica away from the others. Each check here is a digest in an
agreement the ranks exchange anyway, or one exchange of its own every few steps:

* the batch: its digest (``core.digest.batch_digest``) among the ranks that read it
  together (every rank with the same coordinates on the data axes: tensor, sequence and
  pipeline peers), in ``step``'s agreement;
* the optimizer: every group's hyper-parameters (lr, betas, weight decay, ...), in
  ``step``'s agreement or, outside ``step``, in ``meshlab.optimizer``'s own at each step;
* the replicas: each parameter's digest among the ranks that hold the same shard of it,
  every ``check_replicas`` steps of ``meshlab.optimizer`` and at each checkpoint save.
"""

from __future__ import annotations

import torch
from torch import nn

from ..core.agree import agree, alone
from ..core.digest import batch_entry, data_coords, replica_digests

# Steps of ``meshlab.optimizer`` between two checks of the replicas' parameters. Measured
# (``benchmarks/agreement_cost.py``, CPU gloo, world 2, a Llama of 5M parameters): a check
# costs 0.05 to 0.06 of a step, so every 6 steps would stay under 1% (every 50: 0.1%). 50
# keeps it under 1% where a step is cheap beside one read of every parameter (a GPU step
# of a small model: the check's sums read each weight once, a step reads it many times).
CHECK_EVERY = 50


_HYPER_FIX = ("every rank must step with the same hyper-parameters, or the replicas drift "
              "apart; set them alike on every rank (a learning-rate schedule included: "
              "one fed a value, as ReduceLROnPlateau is, needs a value every rank shares, "
              "such as the loss ml.step returns or the loss averaged over the ranks, not "
              "one rank's own)")
_REPLICA_FIX = ("the replicas have diverged (a rank stepped with other hyper-parameters or "
                "data, or code changed one rank's weights); load the last checkpoint")


def batch_peers(rt, batch, name: str = "the batch") -> dict:
    """``agree``'s ``peers`` entry for ``batch``: equal among the ranks that read it."""
    return batch_entry(batch, data_coords(rt), name)


def _plain(v):
    if isinstance(v, torch.Tensor):
        return v.detach().cpu().tolist()
    return v


def hyperparameters(opt: torch.optim.Optimizer) -> dict:
    """``agree``'s ``peers`` entries for every hyper-parameter of every group of ``opt``:
    equal on every rank that has that group (pipeline stages may group their own
    parameters differently)."""
    out = {}
    for i, g in enumerate(opt.param_groups):
        for k, v in g.items():
            if k != "params":
                out[f"optimizer param_groups[{i}][{k!r}]"] = ("every rank", _plain(v),
                                                               _HYPER_FIX)
    return out


def agree_hyperparameters(group, what: str, opt: torch.optim.Optimizer) -> None:
    """Every rank steps ``opt`` with the same hyper-parameters, or every rank raises
    ``RankMismatchError`` naming the group, the key and the ranks."""
    if not alone(group):
        agree(group, what, peers=hyperparameters(opt))


def check_replicas(model: nn.Module, group, what: str) -> None:
    """Every parameter's shard equals that of the other ranks holding the same shard, or
    every rank raises ``RankMismatchError`` naming the first that differs and the ranks."""
    if not alone(group):
        agree(group, what, peers=replica_peers(model))


def replica_peers(model: nn.Module) -> dict:
    """``agree``'s ``peers`` entries of every parameter of ``model`` (see ``check_replicas``)."""
    seen: set = set()
    named = []
    for n, p in model.named_parameters():
        if id(p) not in seen:
            seen.add(id(p))
            named.append((n, p))
    return {f"parameter {n}": (key, d, _REPLICA_FIX)
            for n, (key, d) in replica_digests(named).items()}
