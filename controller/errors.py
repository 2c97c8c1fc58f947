"""Typed errors that library code raises and the CLI turns into one line on stderr, exit 2;
and the warnings it shows as one line each (the work went on, with less than was asked)."""

from __future__ import annotations


class ControllerError(Exception):
    """Base of every error a user can act on (bad input, bad file, bad flag)."""


class ConfigError(ControllerError):
    """A flag, endpoint or option that cannot work as given."""


class PolicyLoadError(ControllerError):
    """A policy spec or file that cannot be served (missing, corrupt, or mismatched)."""


class TraceError(ControllerError):
    """A trace folder or file that cannot be read."""


class ControllerWarning(UserWarning):
    """Base of every warning a user should see: the work went on, but not with all of its input."""


class TraceWarning(ControllerWarning):
    """A trace file that ends in a torn record (a crash while writing): the records before it
    were read, the tear skipped."""
