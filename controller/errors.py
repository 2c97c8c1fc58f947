"""Typed errors that library code raises and the CLI turns into one line on stderr, exit 2."""

from __future__ import annotations


class ControllerError(Exception):
    """Base of every error a user can act on (bad input, bad file, bad flag)."""


class ConfigError(ControllerError):
    """A flag, endpoint or option that cannot work as given."""


class PolicyLoadError(ControllerError):
    """A policy spec or file that cannot be served (missing, corrupt, or mismatched)."""


class TraceError(ControllerError):
    """A trace folder or file that cannot be read."""
