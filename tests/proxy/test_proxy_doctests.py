"""The proxy modules' docstring examples are tests too."""

import doctest

import pytest

from kvobs.proxy import (
    _clock, _digest, _http_spans, _identity, _input, _log, _workers, decide, legs)


@pytest.mark.parametrize(
    "module", [_clock, _digest, _http_spans, _identity, _input, _log, _workers, decide, legs])
def test_doctests(module):
    failures, tried = doctest.testmod(module)
    assert tried > 0 and failures == 0
