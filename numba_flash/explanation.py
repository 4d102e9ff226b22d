"""What ``Dispatcher.explain`` returns: the backend chosen for a call and every candidate's verdict, as text that
prints as lines and as data (``Explanation``, ``Candidate``)."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One backend's line in an ``Explanation``: no ``reasons`` means it can serve the call."""

    name: str
    priority: int | None        # None for a backend that does not exist (forced by a wrong name)
    reasons: tuple[str, ...]
    notes: tuple[str, ...]
    chosen: bool

    @property
    def verdict(self) -> str:
        text = "can serve" if not self.reasons else "; ".join(self.reasons)
        return text + (f" ({'; '.join(self.notes)})" if self.notes else "")


class Explanation(str):
    """What ``Dispatcher.explain`` returns. It is the text itself, so ``print(op.explain(...))`` and
    ``"chosen: cpu" in op.explain(...)`` work; its ``repr`` is that text too, so a notebook cell or the REPL shows
    the lines rather than one quoted string full of ``\\n``. ``.chosen`` (a backend name or None), ``.forced`` and
    ``.candidates`` give the same decision as data; ``_repr_html_`` draws it as a table in Jupyter."""

    op: str
    call: str
    chosen: str | None
    forced: str | None
    candidates: tuple[Candidate, ...]

    def __new__(cls, op: str, call: str, chosen: str | None, forced: str | None,
                candidates: tuple[Candidate, ...]) -> "Explanation":
        lines = [f"{op}: {call}"]
        if chosen is not None:
            lines.append(f"chosen: {chosen}" + (f" (forced by backend={forced!r})" if forced else ""))
        else:
            lines.append("chosen: none (a call would raise NoBackendError)")
        for c in candidates:
            prio = f" [priority {c.priority}]" if c.priority is not None else ""
            lines.append(f"  {c.name}{prio}: {c.verdict}" + ("  <- chosen" if c.chosen else ""))
        self = super().__new__(cls, "\n".join(lines))
        self.op, self.call, self.chosen, self.forced, self.candidates = op, call, chosen, forced, candidates
        return self

    def __repr__(self) -> str:
        return str(self)

    def __reduce__(self) -> tuple[Any, ...]:
        # str's own pickling would call __new__ with the text alone
        return Explanation, (self.op, self.call, self.chosen, self.forced, self.candidates)

    def _repr_html_(self) -> str:
        from html import escape

        head = escape(f"{self.op}: {self.call}")
        chosen = escape(self.chosen) if self.chosen else "none (a call would raise NoBackendError)"
        if self.forced:
            chosen += escape(f" (forced by backend={self.forced!r})")
        rows = "".join(
            f"<tr><td>{'<b>' + escape(c.name) + '</b>' if c.chosen else escape(c.name)}</td>"
            f"<td>{'' if c.priority is None else c.priority}</td><td>{escape(c.verdict)}</td></tr>"
            for c in self.candidates)
        return (f"<div><code>{head}</code><br>chosen: <b>{chosen}</b>"
                f"<table><tr><th>backend</th><th>priority</th><th>verdict</th></tr>{rows}</table></div>")
