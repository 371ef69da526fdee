"""Exit statuses (``kvobs.cli`` says what each means) and the one way a command reports
an input error. The group itself uses them, so this module stays light: no pandas, and
rich only once an error is printed."""

from __future__ import annotations

import os
import sys
from typing import NoReturn

EXIT_OK, EXIT_FAULT, EXIT_INPUT, EXIT_INSUFFICIENT, EXIT_INTERNAL = 0, 1, 2, 3, 4
ENV_DEBUG = "KVOBS_DEBUG"


def fail_input(message: str) -> NoReturn:
    from rich.console import Console  # on use: `--json` output never needs rich
    from rich.markup import escape

    # Escaped: messages carry brackets (pip install 'kvobs[fleet]', ids, paths).
    Console(stderr=True).print(f"[red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    sys.exit(EXIT_INPUT)


# Whether the running command allowed the exit without Python's teardown
# (``allow_quick_exit``); read by the group's ``main`` once the command is done.
_quick_exit_allowed = False


def allow_quick_exit(allowed: bool = True) -> None:
    """The command holds nothing that needs Python's teardown at exit: no thread, no
    file being written, no embedded database (``kvobs diagnose`` of span files or a
    store). When kvobs is the process (the console script, ``python -m kvobs``), it
    then exits as soon as the command's output is flushed: tearing down numpy's and
    pyarrow's modules costs ~30 ms, a tenth of a ``diagnose`` process."""
    global _quick_exit_allowed
    _quick_exit_allowed = allowed


def exit_now_if_allowed(code: object) -> None:
    """``os._exit(code)`` after what a normal exit does that anyone could observe (the
    output flushed, ``atexit`` handlers run), when the command allowed it, nothing else
    runs (one thread) and no tracer or profiler watches (coverage, cProfile: they write
    their data after ``main`` returns); ``KVOBS_DEBUG`` keeps the normal exit. Returns
    otherwise (also when a flush fails: the normal exit reports that as before)."""
    import atexit
    import threading

    if (
        not _quick_exit_allowed
        or not (code is None or isinstance(code, int))
        or threading.active_count() > 1
        or sys.gettrace() is not None
        or sys.getprofile() is not None
        or os.environ.get(ENV_DEBUG)
        or not hasattr(atexit, "_run_exitfuncs")
    ):
        return
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):
        return
    atexit._run_exitfuncs()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):
        return
    os._exit(code or 0)
