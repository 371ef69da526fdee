"""The kvobs monitoring mixin: Grafana dashboards and Prometheus rules, generated from code.

- :mod:`~kvobs.monitoring.config`: selectors, windows, thresholds (the only knobs);
- :mod:`~kvobs.monitoring.queries`: every PromQL expression, shared by panels and rules;
- :mod:`~kvobs.monitoring.dashboards`: the dashboards (grafana-foundation-sdk);
- :mod:`~kvobs.monitoring.rules`: recording and alerting rules with their promtool cases;
- :mod:`~kvobs.monitoring.generate`: writes ``dashboards/`` and ``alerts/``;
- :mod:`~kvobs.monitoring.grafana`: import into Grafana / export for provisioning;
- :mod:`~kvobs.monitoring.live`: check the queries against a live Prometheus.
"""

from kvobs.monitoring.config import DEFAULT, MonitoringConfig

__all__ = ["DEFAULT", "MonitoringConfig"]
