"""The error of a source that cannot be read at all, apart from ``kvobs.sources`` so that
the backends it opens can raise it without importing their opener."""


class SourceError(Exception):
    """The source cannot be read at all (missing path, unknown format)."""
