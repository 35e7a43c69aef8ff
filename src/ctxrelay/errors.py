"""The user-facing errors: one base class, so the CLI and the server catch one thing.

Every error ctxrelay raises on purpose says what was wrong and what to do. Subclasses keep the
builtin they refine (a BindingError is a PermissionError, a TensorFileError a ValueError) so
callers that catch builtins keep working.
"""

from __future__ import annotations


class CtxrelayError(Exception):
    """Bad input, a missing prerequisite or a refused use; the message tells the user what to do."""


class UsageError(CtxrelayError, ValueError):
    """Bad input or a missing prerequisite (data package, artifact, option)."""


class BindingError(CtxrelayError, PermissionError):
    """A state or artifact was offered to a model, tokenizer or tenant it is not bound to."""
