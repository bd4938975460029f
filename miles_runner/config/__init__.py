"""Typed configuration: schema, loader, Hydra composition and provenance."""
