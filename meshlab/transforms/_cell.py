"""The value of one cell of the composition table (``composition``): its status, how a
pair not yet shown is refused, and the test that shows a composing pair."""

from __future__ import annotations

import dataclasses

COMPOSES, NOT_YET, MEANINGLESS = "composes", "not yet", "meaningless"
RAISES, RECORDS, AT_OPTIMIZER = "ConfigError", "NotRunnable", "meshlab.optimizer"
ALWAYS, SEVERAL_DATA_RANKS = "always", "over more than one data rank"
TP_REGIONS = "where shard runs a policy's tensor-parallel regions"
SCOPES = (ALWAYS, SEVERAL_DATA_RANKS, TP_REGIONS)
PAGE = "docs/composition.md"


@dataclasses.dataclass(frozen=True)
class Cell:
    """One pair of rows of the table (``composition``'s doc says what each status means).

    ``message`` is the refusal's text, with ``{a}`` and ``{b}`` the transforms that hold
    the pair's rows in the order the table names them, ``{tp}`` the tensor-parallel axis
    and ``{ranks}`` the data ranks; ``note`` says what a test or a cell leaves out;
    ``before`` names the row that must come first in a spec (``shard`` before ``lora``).
    """

    status: str
    test: str | None = None
    reason: str = ""
    refusal: str = RAISES
    scope: str = ALWAYS
    message: str = ""
    note: str = ""
    before: str | None = None

    def __post_init__(self):
        from ..core.errors import ConfigError

        if self.status not in (COMPOSES, NOT_YET, MEANINGLESS):
            raise ConfigError(f"Cell(status={self.status!r}): one of {COMPOSES!r}, "
                              f"{NOT_YET!r}, {MEANINGLESS!r}")
        if self.refusal not in (RAISES, RECORDS, AT_OPTIMIZER) or \
                self.scope not in SCOPES:
            raise ConfigError(f"Cell(refusal={self.refusal!r}, scope={self.scope!r}): refusal "
                              f"is one of {RAISES!r}, {RECORDS!r}, {AT_OPTIMIZER!r}; scope one "
                              f"of {SCOPES!r}")
        if self.status != COMPOSES and not self.reason:
            raise ConfigError(f"Cell({self.status!r}): say why (reason=...)")

    @property
    def refused(self) -> bool:
        """Whether the pair is refused (``not yet`` or ``meaningless``)."""
        return self.status != COMPOSES

    def mark(self) -> str:
        """The cell's mark in the page's matrix."""
        if self.status == MEANINGLESS:
            return "-"
        if self.status == NOT_YET:
            return {RAISES: "E", RECORDS: "N", AT_OPTIMIZER: "O"}[self.refusal] + \
                {ALWAYS: "", SEVERAL_DATA_RANKS: "*", TP_REGIONS: "^"}[self.scope]
        return "✓" if self.test else "○"

    def describe(self) -> str:
        """The status as the page spells it."""
        if self.status == COMPOSES:
            return "composes" if self.test else "composes (no parity test yet)"
        if self.status == MEANINGLESS:
            return "meaningless"
        how = {RAISES: "plan raises ConfigError", RECORDS: "plan records NotRunnable",
               AT_OPTIMIZER: "meshlab.optimizer raises ConfigError"}[self.refusal]
        return f"not yet ({how}{'' if self.scope == ALWAYS else ', ' + self.scope})"


def composes(test: str | None = None, note: str = "", *, before: str | None = None,
             message: str = "") -> Cell:
    """A pair that composes; ``test`` is the node id of its parity test, if one exists."""
    return Cell(COMPOSES, test=test, note=note, before=before, message=message)


def not_yet(reason: str, message: str = "", refusal: str = RAISES, scope: str = ALWAYS,
            note: str = "") -> Cell:
    """A pair not shown to compose yet, refused as ``refusal`` says."""
    return Cell(NOT_YET, reason=reason, refusal=refusal, scope=scope,
                message=message or "{a} with {b}: " + reason, note=note)


def meaningless(reason: str) -> Cell:
    """Two variants of one kind on one axis."""
    return Cell(MEANINGLESS, reason=reason)
