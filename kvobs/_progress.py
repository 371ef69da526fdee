"""Progress on the terminal for work that can take more than a couple of seconds
(``kvobs report`` over a large store, trace-API searches read trace by trace, ``kvobs
store compact``, ``kvobs demo`` start-up): the one implementation every command uses.

Shown on stderr, and only when stderr is a terminal: stdout carries a command's data
(its table, its ``--json``), and a pipe or a file gets exactly the bytes it got without
a progress display. The display is transient: it is erased when the work ends, so a
terminal keeps only the output. ``KVOBS_NO_PROGRESS=1`` (or ``TERM=dumb``) turns it off.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import IO, Iterator


def escape(text: str) -> str:
    """``text`` shown as it is by rich (rich is imported only once a display is shown)."""
    from rich.markup import escape as rich_escape

    return rich_escape(text)


__all__ = ["Progress", "progress", "shown"]


def shown(stream: IO[str] | None = None) -> bool:
    """Whether a progress display goes to ``stream`` (default stderr): a terminal, and
    not turned off."""
    stream = sys.stderr if stream is None else stream
    if os.environ.get("KVOBS_NO_PROGRESS") or os.environ.get("TERM") == "dumb":
        return False
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or closed
        return False


class Progress:
    """What a progress block can say: steps done, what it is doing, a line to keep.
    Without a terminal every call does nothing (``line`` goes to ``fallback``)."""

    def __init__(self, bar=None, task=None, fallback=None):
        self._bar, self._task, self._fallback = bar, task, fallback

    @property
    def live(self) -> bool:
        return self._bar is not None

    def advance(self, steps: float = 1) -> None:
        if self._bar is not None:
            self._bar.advance(self._task, steps)

    def total(self, total: float | None) -> None:
        """Sets how many steps the work has, once it is known."""
        if self._bar is not None:
            self._bar.update(self._task, total=total)

    def describe(self, text: str) -> None:
        if self._bar is not None:
            # Plain text: a log line's "[testbed]" is no markup tag to drop.
            self._bar.update(self._task, description=escape(text))

    def line(self, text: str) -> None:
        """A line of the work's log: the display's description, and kept above the
        display when stdout is the terminal too; else ``fallback(text)`` (the caller's
        usual output, if any), so a redirected stdout gets the bytes it always got."""
        self.describe(text)
        if self._bar is not None and shown(sys.stdout):
            self._bar.console.print(text, highlight=False, markup=False)
        elif self._fallback is not None:
            self._fallback(text)


@contextlib.contextmanager
def progress(
    description: str, total: float | None = None, fallback=None, stream: IO[str] | None = None
) -> Iterator[Progress]:
    """A progress display on ``stream`` (default stderr) while the block runs: a bar when
    ``total`` steps are known, else a spinner, with the time elapsed. Yields a
    ``Progress`` whose calls do nothing when ``stream`` is no terminal."""
    stream = sys.stderr if stream is None else stream
    if not shown(stream):
        yield Progress(fallback=fallback)
        return
    from rich import progress as rich_progress
    from rich.console import Console

    columns = (
        rich_progress.SpinnerColumn(),
        rich_progress.TextColumn("{task.description}"),
        rich_progress.BarColumn(),
        rich_progress.MofNCompleteColumn(),
        rich_progress.TimeElapsedColumn(),
    )
    console = Console(file=stream)
    with rich_progress.Progress(*columns, console=console, transient=True) as bar:
        yield Progress(bar, bar.add_task(escape(description), total=total), fallback)
