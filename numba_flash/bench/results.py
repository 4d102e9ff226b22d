"""What a bench run gives back: one ``Row`` per runner, pass and case, gathered in ``BenchResults``."""

from __future__ import annotations

import warnings
from typing import Any, Iterator, Sequence, overload

from .cases import Case
from .harness import busy_warning
from .rows import CSV_COLUMNS, Row


class NoisyTimingWarning(UserWarning):
    """Some measurement of a bench run was disturbed by other work on the machine (see ``harness.BUSY_SPREAD``)."""


class BenchResults(Sequence[Row]):
    """The rows of a run with the run's ``meta`` (machine, versions, threads, seed) and ``notes`` (lines worth
    reading under the table: disturbed timings, a reference too big to compute). Indexing and iteration give the
    rows; ``records()``, ``to_dataframe()``, ``table()`` and ``plot()`` give them in other forms. In a notebook the
    object shows as its table."""

    def __init__(self, rows: Sequence[Row], meta: dict[str, Any], notes: Sequence[str] = ()):
        self.rows = list(rows)
        self.meta = dict(meta)
        self.notes = list(notes)

    @overload
    def __getitem__(self, i: int) -> Row: ...

    @overload
    def __getitem__(self, i: slice) -> list[Row]: ...

    def __getitem__(self, i: Any) -> Any:
        return self.rows[i]

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self) -> Iterator[Row]:
        return iter(self.rows)

    @property
    def cases(self) -> list[Case]:
        """The distinct cases, in run order."""
        return list(dict.fromkeys(r.case for r in self.rows))

    @property
    def noisy(self) -> list[Row]:
        """Rows whose timings say the machine was busy."""
        return [r for r in self.rows if r.status == "ok" and r.stats is not None and r.stats.busy]

    @property
    def errors(self) -> list[Row]:
        """Rows whose backend or peer raised."""
        return [r for r in self.rows if r.status.startswith("error")]

    @property
    def skipped(self) -> list[Row]:
        """Rows that could not run here, with the reason in ``status``."""
        return [r for r in self.rows if r.status.startswith("skipped")]

    def records(self) -> list[dict[str, Any]]:
        """One dict per row, keys as ``CSV_COLUMNS``."""
        return [r.record() for r in self.rows]

    def to_dataframe(self) -> Any:
        """The records as a ``pandas.DataFrame`` (needs pandas)."""
        try:
            import pandas as pd
        except ImportError:
            raise ImportError("BenchResults.to_dataframe needs pandas (pip install pandas); records() gives the "
                              "same data as a list of dicts") from None
        return pd.DataFrame(self.records(), columns=list(CSV_COLUMNS))

    def table(self, tablefmt: str = "simple") -> str:
        """The measured rows as a table (``tabulate`` format name), followed by the skipped and failed ones."""
        from .report import format_table

        return format_table(self.rows, tablefmt=tablefmt)

    def plot(self, ax: Any = None, title: str | None = None) -> Any:
        """TFLOP/s against sequence length (log y) with error bars, into ``ax`` or a new figure; returns the
        figure. Never touches matplotlib's global backend."""
        from .plot import plot_rows

        return plot_rows(self.rows, ax=ax, title=title or self.title())

    def title(self) -> str:
        """The case, threads and machine in one line (the plot's title)."""
        from .plot import title_for

        return title_for(self.cases, self.meta)

    def write_csv(self, path: str) -> None:
        """The records as CSV, columns ``CSV_COLUMNS``."""
        from .report import write_csv

        write_csv(path, self.rows)

    def write_json(self, path: str) -> None:
        """``{"meta": ..., "results": [record, ...]}``."""
        from .report import write_json

        write_json(path, self.rows, self.meta)

    def warn_if_noisy(self) -> None:
        """A ``NoisyTimingWarning`` naming the disturbed measurements, if any."""
        noisy = self.noisy
        if noisy:
            warnings.warn(busy_warning([(r.label, r.stats) for r in noisy]), NoisyTimingWarning, stacklevel=3)

    def __repr__(self) -> str:
        lines = [f"BenchResults: {len(self.rows)} rows, {self.title()}", self.table()]
        return "\n".join(lines + self.notes)

    def _repr_html_(self) -> str:
        from html import escape

        notes = "".join(f"<p>{escape(n)}</p>" for n in self.notes)
        return f"<p>{escape(self.title())}</p>{self.table('html')}{notes}"
