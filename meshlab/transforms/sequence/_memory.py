"""What one rank of Ulysses or ring attention holds, from the activation profile of one
process at the whole sequence (``meshlab.estimate.profile``; ``Sequence.profile`` puts
the room's own attention in the profiled block, ``profile_attention`` of ``_ring`` and
``_ulysses``). By where a row of the profile lives:

* inside the blocks: the rank's share of the sequence, S/n of each row (Ulysses inside
  attention: H/n heads of the whole sequence, the same bytes);
* outside the blocks (embeddings, rotary tables, final norm, head, loss and its
  gradient): the whole sequence on every rank, since the sequence is cut before the first
  block and joined after the last (``install_split``);
* the hidden states at the seams. The first block's input is ``x.chunk(n, 1)[r]
  .contiguous()`` of the whole sequence (``core.collectives._split``; ring first permutes
  the whole into zigzag order, a new whole-sequence tensor): where the dims before the
  sequence are all 1 (one sequence per rank) the chunk is contiguous already, a view, and
  keeps the whole tensor it was cut from alive for as long as the block keeps its input;
  else it is a copy of S/n. The later blocks' inputs are the earlier blocks' outputs, S/n.
  The last block's output, where the final norm keeps it, is kept gathered: the whole
  sequence;
* the tables the blocks read that are made outside them (the rotary cos and sin, read
  inside attention): cut for each block by the same ``_split``. Ulysses cuts the tables
  themselves: views of one whole copy every block shares (a copy of S/n per block where the
  cut is not a view). Ring permutes them into zigzag order for each block first, so each
  block keeps a whole-sequence copy of its own (S/n where the cut is not a view).

The gradients are left as they are (the rank's, from the memory rows).
"""

from __future__ import annotations

import dataclasses


def _view(shape: tuple[int, ...]) -> bool:
    """Whether cutting dim 1 of a contiguous tensor of ``shape`` into chunks gives views
    (every dim before it is 1), which keep the whole tensor alive."""
    return shape[0] == 1


def _inside(module: str, block: str) -> bool:
    return module == block or module.startswith(block + ".")


def rank_rows(rows: list, *, n: int, mode: str, block: str, n_blocks: int,
              width: int | None) -> list:
    """The profile's rows (one process, the whole sequence) as one rank of ``n`` holds
    them under ``mode`` (``'all_to_all'`` or ``'ring'``): the module docstring. ``block``
    is the profiled block (the first), ``n_blocks`` how many blocks the rank runs,
    ``width`` the hidden size. The rows at the step's peak carry no roles: there the
    block's output is the row made inside the block that the forward read outside it,
    its input the row of the hidden states' width made outside and read inside."""
    share = f"/{n} sp"
    out = []
    whole_input = False           # the first block's input, kept whole, counted once
    for r in rows:
        if r.grad or not r.shape:
            out.append(r)
            continue
        read_in = any(_inside(u, block) for u in r.users)
        read_out = any(not _inside(u, block) for u in r.users)
        seam_in = r.role == "block_input" or (
            not r.role and not r.in_block and read_in and r.shape[-1] == width)
        if r.role == "block_output" or (not r.role and r.in_block and read_out):
            out.append(_noted(r, "whole sequence: gathered after the last block"))
        elif seam_in:
            if whole_input or not _view(r.shape):
                out.append(r.split(n, share))
                continue
            whole_input = True
            out.append(dataclasses.replace(
                _noted(r, "whole sequence: the first block's input is a view of it"),
                copies=min(r.copies, 1.0)))
            if r.copies > 1:
                out.append(dataclasses.replace(r.split(n, share), copies=r.copies - 1))
        elif r.in_block:
            out.append(r.split(n, share))
        elif read_in:
            if not _view(r.shape):
                out.append(dataclasses.replace(r.split(n, share + ", a copy per block"),
                                               copies=r.copies * n_blocks))
            elif mode == "ring":
                out.append(dataclasses.replace(
                    _noted(r, "whole sequence, permuted for each block"),
                    copies=r.copies * n_blocks))
            else:
                out.append(_noted(r, "whole sequence, one copy the blocks' views share"))
        else:
            out.append(_noted(r, "whole sequence: outside the blocks"))
    return out


def _noted(r, why: str):
    return dataclasses.replace(r, note=(r.note + " " + why).strip())
