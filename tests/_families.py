"""A parity harness for model families of any input kind (text, images, audio, seq2seq).

A family is a ``Family``: a tiny config, the auto class that builds it, a batch maker and
a loss. ``parity_case`` runs on every rank of a gloo world: it trains the single-process
reference on the global batch and the parallelized model on this rank's share (each
batch tensor split on dim 0 over the data-parallel ranks), three AdamW steps, and
compares the losses of every step, the gradients of the first and the weights after the
last (float32, the tolerances of ``test_parallel_gloo``).
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Callable

import torch

from . import _models as M


@dataclasses.dataclass(frozen=True)
class Family:
    config: dict                      # model_type plus the tiny config's fields
    auto: str                         # transformers auto class, e.g. "AutoModelForCausalLM"
    batch: Callable                   # (batch size, torch.Generator) -> dict of tensors
    loss: Callable                    # (model output, batch) -> scalar tensor
    inputs: tuple[str, ...] | None = None   # batch keys passed to the model (None: all)
    # model -> None, after init_weights: values the model's own init leaves degenerate
    # (BLIP-2's zero query tokens); the parallel model then loads the same state_dict
    post_init: Callable | None = None
    # () -> the model on the meta device, for families transformers does not ship (remote
    # code); config and auto are then unused
    make: Callable | None = None


def build(fam: Family):
    import transformers

    if fam.make is not None:
        return fam.make()
    kw = dict(fam.config)
    cfg = transformers.AutoConfig.for_model(kw.pop("model_type"), **kw)
    cfg._attn_implementation = "eager"
    with torch.device("meta"):
        return getattr(transformers, fam.auto).from_config(cfg)


def family(module: str, name: str) -> Family:
    return getattr(importlib.import_module(module), "FAMILIES")[name]


def _call(model, fam: Family, batch: dict):
    keys = fam.inputs if fam.inputs is not None else tuple(batch)
    return model(**{k: batch[k] for k in keys})


def _batches(fam: Family, steps: int, size: int, seed: int = 1) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [fam.batch(size, g) for _ in range(steps)]


def parity_case(rank, world, module=None, name=None, spec_name="tp_zero3", steps=3, lr=1e-3,
                tols=(1e-5, 1e-3, 1e-6, 1e-4, 1e-4, 1e-3), batch_size=4, fam=None):
    """``fam``: the family itself, where a case builds it on the rank (else ``FAMILIES[name]``
    of ``module``)."""
    import torch.distributed as dist

    import meshlab as ml

    fam = fam if fam is not None else family(module, name)
    data = _batches(fam, steps, batch_size)
    a_l, r_l, a_g, r_g, a_w, r_w = tols
    ref = ml.init_weights(build(fam), seed=0)
    state = None
    if fam.post_init is not None:
        with torch.no_grad():
            fam.post_init(ref)
        state = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    opt_r = torch.optim.AdamW(ref.parameters(), lr=lr)
    ref_losses, ref_grads = [], None
    for i, b in enumerate(data):
        loss = fam.loss(_call(ref, fam, b), b)
        loss.backward()
        if i == 0:
            ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters()
                         if p.grad is not None}
        opt_r.step()
        opt_r.zero_grad()
        ref_losses.append(loss.item())

    model = ml.parallelize(build(fam), M.spec(spec_name), M.mesh_for(spec_name, world), seed=0,
                           state_dict=state)
    opt = ml.optimizer(model, torch.optim.AdamW, lr=lr)
    rt = model._meshlab
    dp_rank = dist.get_rank(rt.dp_group) if rt.dp_group is not None else 0
    losses = []
    for i, b in enumerate(data):
        local = {k: v.chunk(rt.dp_size)[dp_rank] for k, v in b.items()}
        loss = fam.loss(_call(model, fam, local), local)
        loss.backward()
        if i == 0:
            opt._sync_grads()
            for n, p in model.named_parameters():
                if p.grad is not None and n in ref_grads:
                    torch.testing.assert_close(M.full(p.grad), ref_grads[n], atol=a_g,
                                               rtol=r_g, msg=lambda m, n=n: f"grad of {n}: {m}")
        opt.step()
        opt.zero_grad()
        t = torch.tensor([loss.item()], dtype=torch.float64)
        if rt.dp_group is not None:
            dist.all_reduce(t, group=rt.dp_group)
        losses.append(float(t) / rt.dp_size)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), atol=a_l,
                               rtol=r_l)
    M.assert_weights_match(model, ref, atol=a_w, rtol=r_w)
    return {"losses": losses, "ref": ref_losses}
