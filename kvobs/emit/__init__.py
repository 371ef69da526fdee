"""Emission side: how kvobs components turn facts into spans.

Emitters depend on the OTel API only (``spans.py``); the SDK and exporters are chosen in
one place (``setup.py``) from the standard ``OTEL_*`` variables or the embedded store.
"""
