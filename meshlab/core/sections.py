"""Collective sections: code in which an exception on one rank must reach every rank.

A training forward on many ranks is collective: its backward reduces gradients over the
data axes, and rooms run collectives inside it (expert dispatch). A rank whose forward
raises, and whose loop then skips the batch, would leave the others waiting in the next
collective for good (or pair their collectives with its next batch's). A section closes
that gap with agreements (``meshlab.core.agree``) at the points where ranks can diverge:

* at its end every rank agrees: all continue, or, where one raised, it re-raises its own
  error and the others raise ``PeerError`` naming it, all at the same point, with nothing
  left half done (so a skip-the-batch loop goes on in step on every rank);
* inside it, a room whose next collective would wait for a rank that may have failed
  calls ``boundary`` first: the failed rank's agreement meets the others there.

A failed rank leaves its code at the exception and agrees once, at the section's exit;
the others' next agreement (a boundary or the end) is the one it meets. Sections nest:
only the outermost agrees at its end (a model's forward inside ``step``'s section is one
section). An error an agreement raised is raised on every rank already and passes
through without another exchange.

Cost: one control exchange (two small gloo all-gathers) per section and per boundary;
``benchmarks/agreement_cost.py`` measures it.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Mapping

from .agree import agree, agreed, alone

# The control group of the outermost active section this process is inside (the forward
# runs on the thread that called it; an agreement never runs inside another).
_ACTIVE: list = []


def inside() -> bool:
    """Whether this process runs inside an active section (whose end agrees)."""
    return bool(_ACTIVE)


@contextlib.contextmanager
def section(group, what: str, *, active: bool = True,
            peers: Callable[[], Mapping[str, tuple[Any, Any]]] | None = None):
    """Run the body as one collective section over ``group`` (see the module doc).
    ``active=False``, a nested section or a group of one rank: the body runs as it is.
    ``peers()`` gives values its end agreement compares (``agree``'s ``peers``), read as
    the section starts (what the body was given)."""
    if not active or _ACTIVE or alone(group):
        yield
        return
    given = peers() if peers is not None else None
    _ACTIVE.append(group)
    try:
        yield
    except Exception as e:           # re-raised below, once every rank has heard of it
        _ACTIVE.pop()
        if not agreed(e):
            agree(group, what, error=e)      # raises e here, PeerError on the others
        raise
    except BaseException:            # an interrupt: no exchange, this process stops
        _ACTIVE.pop()
        raise
    _ACTIVE.pop()
    agree(group, what, peers=given)


def boundary(what: str) -> None:
    """Before a collective whose peers may have failed since the section's last
    agreement: every rank of the active section agrees it got here (nothing outside one:
    an evaluation forward may run on one rank alone)."""
    if _ACTIVE:
        agree(_ACTIVE[-1], what)
