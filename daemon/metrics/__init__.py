"""Prometheus metrics of one inboxd process and the gauges kept current from the database."""
