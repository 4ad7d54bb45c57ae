"""Shared utilities: atomic output directories, provenance, metrics logging."""
