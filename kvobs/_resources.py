"""Files kvobs ships beside its code: the testbed's scenarios, the alerts' runbooks and the
generated dashboards and rules.

One copy of each lives at the repository root, where docs, tests and ``make`` use it. A
wheel carries them as package data under ``kvobs/_data/`` (``setup.py`` copies
``SHIPPED`` there at build time), so an installed kvobs finds them without a clone.
"""

from __future__ import annotations

from pathlib import Path

# Repository-relative folders the wheel carries (the last: the generated PrometheusRule
# and dashboards ConfigMap).
SHIPPED = (
    "scenarios",
    "docs/runbooks",
    "dashboards",
    "alerts",
    "deploy/kubernetes/base/monitoring",
)

PACKAGED = Path(__file__).resolve().with_name("_data")
REPO_ROOT = Path(__file__).resolve().parents[1]


def resource(relative: str) -> Path:
    """``relative`` (under one of ``SHIPPED``) in the installed package data, else in the
    repository; the repository path when neither has it (so the error names it)."""
    packaged = PACKAGED / relative
    return packaged if packaged.exists() else REPO_ROOT / relative
