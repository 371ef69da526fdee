"""The wheel carries the repository's shipped files (``kvobs._resources.SHIPPED``) under
``kvobs/_data/``: one copy in the repository, a build-time copy in the wheel. And two
compiled fast paths, optional: the decoder of kvobs collect's OTLP/protobuf requests
(``kvobs/emit/native.py``; the service's start-up log says which decoder runs) and the
span table's row-to-column loop (``kvobs/sources/_frame.py``). Where no C compiler is
found the install goes on and their Python versions do the work. Everything else is in
pyproject.toml."""

import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
from kvobs._resources import SHIPPED  # noqa: E402  (a stdlib-only module)


class BuildWithShippedFiles(build_py):
    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return  # an editable install reads them from the repository
        target = Path(self.build_lib) / "kvobs" / "_data"
        for relative in SHIPPED:
            self.copy_tree(str(ROOT / relative), str(target / relative))


setup(
    cmdclass={"build_py": BuildWithShippedFiles},
    ext_modules=[
        Extension("kvobs.emit._otlp_native", ["kvobs/emit/_otlp_native.c"], optional=True),
        Extension(
            "kvobs.sources._columns_native", ["kvobs/sources/_columns_native.c"], optional=True
        ),
    ],
)
