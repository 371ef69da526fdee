"""Exit statuses (``kvobs.cli`` says what each means) and the one way a command reports
an input error. The group itself uses them, so this module stays light: no pandas, and
rich only once an error is printed."""

from __future__ import annotations

import sys
from typing import NoReturn

EXIT_OK, EXIT_FAULT, EXIT_INPUT, EXIT_INSUFFICIENT, EXIT_INTERNAL = 0, 1, 2, 3, 4


def fail_input(message: str) -> NoReturn:
    from rich.console import Console  # on use: `--json` output never needs rich
    from rich.markup import escape

    # Escaped: messages carry brackets (pip install 'kvobs[fleet]', ids, paths).
    Console(stderr=True).print(f"[red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    sys.exit(EXIT_INPUT)
