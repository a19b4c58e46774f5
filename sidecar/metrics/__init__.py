"""Prometheus metrics and the HTTP endpoints /metrics /healthz /readyz /status.

Imports: prometheus-client, aiohttp. Each Metrics object owns its own CollectorRegistry.
"""
