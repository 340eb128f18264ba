"""The ranks of a parallelized engine serve the same requests, or every rank raises.

Under tensor (or pipeline) parallelism every rank runs the same scheduler on the same
requests, each step's collectives assuming it: a rank whose prompt holds other tokens of
the same length computes its half of every layer on another sequence (garbage, both ranks
agreeing), another sampling seed returns other tokens on each rank, another
``max_new_tokens`` leaves one rank in a collective the others never enter, and another
prompt length or request count pairs collectives of different sizes (a crash). So before
each step's first collective every rank exchanges what it is about to run (one control
exchange, ``core.agree``): the requests added since the last step (their tokens,
lengths, ``max_new_tokens``), the queue (waiting, running, tokens generated each), the
configuration (sampling parameters, seed, ...) and the sampling generator's state. Any
difference raises ``RankMismatchError`` on every rank, naming what differs and the
ranks, before anything runs.

A step that raised on one rank alone (after its collectives, or in a stage a pipeline
keeps going, ``_pipeline``) leaves that rank's requests behind the others': it says so at
its next step's exchange, where every rank raises (``PeerError`` on the others, naming
the error); a rank that stops altogether fails the others there after the control
timeout (``MESHLAB_CONTROL_TIMEOUT``). The engines then no longer agree: build new ones.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib

from ..core.agree import agree, agreed, alone, digest
from ..core.errors import PeerError
from ..transforms._install import runtime_or_none

_FIX = ("every rank of a parallelized engine serves the same requests: add the same prompts "
        "with the same max_new_tokens on every rank, with the same InferenceConfig (its seed "
        "and sampling parameters included), and step every engine alike")


class StepAgreement:
    """What one engine's ranks agree on before each step (module doc)."""

    def __init__(self, model) -> None:
        rt = runtime_or_none(model)
        self.group = rt.ctrl_group if rt is not None else None
        self.new: list = []                   # requests added since the last agreement
        self.failed: BaseException | None = None    # this rank's step that raised alone

    def added(self, request) -> None:
        if not alone(self.group):
            self.new.append(request)

    def before_step(self, engine) -> None:
        """Every rank is about to run the same step, or every rank raises."""
        if alone(self.group):
            return
        error = None
        if self.failed is not None:
            error = PeerError(
                f"InferenceEngine.step: this rank's earlier step failed alone "
                f"({type(self.failed).__name__}: {self.failed}), so its requests are behind "
                f"the other ranks'; build a new engine on every rank")
        new, self.new = self.new, []
        values = {}
        if new:      # where requests start, the configuration field by field (named)
            values = {f"InferenceConfig.{f.name}": repr(getattr(engine.config, f.name))
                      for f in dataclasses.fields(engine.config)}
        values.update({
            "requests added": [[len(r.prompt), r.max_new_tokens, digest(r.prompt)]
                               for r in new],
            "queue": [len(engine.waiting), digest([[r.rid, len(r.generated)]
                                                    for r in engine.running])],
            "InferenceConfig": digest(repr(engine.config)),
        })
        if _chooses(engine):       # only the ranks that choose tokens draw from it
            values["sampling generator"] = hashlib.sha256(
                engine.gen.get_state().numpy().tobytes()).hexdigest()[:16]
        peers = {name: ("every rank", v, _FIX) for name, v in values.items()}
        agree(self.group, "InferenceEngine.step", error=error, peers=peers)

    def step_failed(self, error: BaseException) -> None:
        """This rank's step raised where the others may have gone on (see module doc)."""
        if not alone(self.group) and not agreed(error):
            self.failed = error


def _chooses(engine) -> bool:
    """Whether this rank chooses tokens (every rank; under a pipeline, the last stage's)."""
    import torch.distributed as dist

    return engine.pipe is None or dist.get_rank() == engine.pipe.last_rank


def agreed_step(step):
    """``InferenceEngine.step`` with the agreement before it, and a failure of it on this
    rank alone kept for the next one (module doc)."""
    @functools.wraps(step)
    def run(engine):
        engine.agreement.before_step(engine)
        try:
            finished = step(engine)
            failed = engine.pipe.take_failed() if engine.pipe is not None else None
            if failed is not None:      # a stage raised; its zeros kept the others going
                raise failed
            return finished
        except Exception as e:       # raised here; the others hear of it at their next step
            engine.agreement.step_failed(e)
            raise
    return run
