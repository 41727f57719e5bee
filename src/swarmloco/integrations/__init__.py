"""Integrations with other training libraries (optional extras)."""
