"""Bundled example traces (SIMULATED from the bundled deployments; see README.md)."""
