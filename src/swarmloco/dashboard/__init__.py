"""The read-only dashboard: HTTP app, Prometheus metrics and the static page."""
