"""What ``verify`` returns: per step, the loss of the layout and of its reference, each
parameter's gradient and weight difference, and the first module whose output diverges."""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class Diff:
    """One value of the layout against the reference's: ``max_abs`` is the largest
    elementwise difference, ``scale`` the largest magnitude of the reference's value;
    ``ok`` says ``max_abs <= atol + rtol * scale`` (the report's tolerance)."""

    name: str
    max_abs: float
    scale: float
    ok: bool

    @property
    def rel(self) -> float:
        """``max_abs`` relative to ``scale`` (0 where both are 0)."""
        if self.max_abs == 0.0:
            return 0.0
        return self.max_abs / self.scale if self.scale > 0 else math.inf

    def __str__(self) -> str:
        return f"{self.name} {self.max_abs:.2e} ({self.rel:.1e})"


@dataclasses.dataclass(frozen=True)
class StepDiff:
    """One training step: both losses, each parameter's gradient (``grads``) and weight
    after the step (``weights``), the modules compared in execution order and the first
    whose output diverges (``first_module``, None where all agree)."""

    step: int
    loss: float
    reference_loss: float
    loss_ok: bool
    grads: tuple[Diff, ...]
    weights: tuple[Diff, ...]
    modules: tuple[Diff, ...]
    first_module: Diff | None

    @property
    def ok(self) -> bool:
        """Whether the loss, every gradient and every weight are within the tolerance."""
        return self.loss_ok and all(d.ok for d in self.grads + self.weights)

    @property
    def bad_grads(self) -> tuple[str, ...]:
        """The parameters whose gradient is off, in the model's order."""
        return tuple(d.name for d in self.grads if not d.ok)

    @property
    def bad_weights(self) -> tuple[str, ...]:
        """The parameters whose weight after the step is off, in the model's order."""
        return tuple(d.name for d in self.weights if not d.ok)


def _worst(diffs) -> Diff | None:
    return max(diffs, key=lambda d: (not d.ok, d.max_abs), default=None)


@dataclasses.dataclass(frozen=True)
class VerifyReport:
    """A layout trained beside its reference (``meshlab.verify``). ``ok``: the starting
    weights, and every step's loss, gradients and weights, are within the tolerance
    (``|layout - reference| <= atol + rtol * max|reference|``, per tensor). ``str()`` is a
    text table; in a notebook or ``rich.print`` it is a rich table."""

    layout: str
    reference: str
    atol: float
    rtol: float
    gradient: str            # 'gradient' (SGD: update / -lr) or 'update' (other optimizers)
    start: tuple[Diff, ...]
    steps: tuple[StepDiff, ...]
    notes: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return all(d.ok for d in self.start) and all(s.ok for s in self.steps)

    @property
    def first_bad_step(self) -> StepDiff | None:
        """The first step whose loss, gradients or weights are off."""
        return next((s for s in self.steps if not s.ok), None)

    @property
    def first_module(self) -> str | None:
        """The first module (in execution order) whose output diverges, at the first step
        where one does."""
        return next((s.first_module.name for s in self.steps if s.first_module), None)

    def summary(self) -> str:
        """One line: agrees, or where it first does not."""
        if self.ok:
            return f"{self.layout} agrees with {self.reference} over {len(self.steps)} steps"
        bad_start = [d.name for d in self.start if not d.ok]
        if bad_start:
            return f"{self.layout}: the starting weights differ: {', '.join(bad_start[:4])}"
        s = self.first_bad_step
        parts = [f"step {s.step}: loss {s.loss:.6g} vs {s.reference_loss:.6g}"]
        if s.bad_grads:
            parts.append(f"{self.gradient} off: {', '.join(s.bad_grads[:4])}")
        if s.first_module is not None:
            parts.append(f"first diverging module: {s.first_module.name}")
        return f"{self.layout}: " + "; ".join(parts)

    def rows(self) -> list[tuple[str, ...]]:
        """The table's rows: per step, the losses, the worst gradient and weight, and the
        first diverging module."""
        out = []
        for s in self.steps:
            g, w = _worst(s.grads), _worst(s.weights)
            out.append((str(s.step), f"{s.loss:.8g}", f"{s.reference_loss:.8g}",
                        f"{abs(s.loss - s.reference_loss):.1e}", str(g) if g else "-",
                        str(w) if w else "-",
                        str(s.first_module) if s.first_module else "-",
                        "ok" if s.ok else "OFF"))
        return out

    _HEAD = ("step", "loss", "reference", "|diff|", "worst {g} (max abs, rel)",
             "worst weight (max abs, rel)", "first diverging module", "")

    def _head(self) -> tuple[str, ...]:
        return tuple(h.format(g=self.gradient) for h in self._HEAD)

    def __str__(self) -> str:
        rows = [self._head()] + self.rows()
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = [f"verify: {self.layout} against {self.reference} (atol {self.atol:g}, "
                 f"rtol {self.rtol:g}): {'ok' if self.ok else 'DIVERGES'}"]
        bad = [d for d in self.start if not d.ok]
        if bad:
            lines.append("starting weights off: " + ", ".join(str(d) for d in bad[:6]))
        lines += ["  ".join(c.ljust(wd) for c, wd in zip(r, widths)).rstrip() for r in rows]
        for s in self.steps:
            if not s.ok:
                for what, names in ((self.gradient, s.bad_grads), ("weight", s.bad_weights)):
                    if names:
                        lines.append(f"step {s.step}: {what} off for {len(names)}: "
                                     + ", ".join(names[:6]) + (" ..." if len(names) > 6 else ""))
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def __rich__(self):
        from rich.table import Table

        t = Table(title=f"verify: {self.layout} against {self.reference}: "
                        f"{'ok' if self.ok else 'DIVERGES'}",
                  caption=f"atol {self.atol:g}, rtol {self.rtol:g}" + "".join(
                      f"\n{n}" for n in self.notes))
        for h in self._head():
            t.add_column(h)
        for r in self.rows():
            t.add_row(*r, style=None if r[-1] == "ok" else "red")
        return t
