"""The simulator's typed error, beside the project's base error the CLI reports (exit 2)."""

from __future__ import annotations

from controller.errors import ControllerError


class FitError(ControllerError):
    """Input to fitting, or a simulator parameter file, that cannot be used; the message names
    the file and the problem."""
