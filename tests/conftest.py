"""Shared pytest configuration (markers live in pyproject.toml)."""
