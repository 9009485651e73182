"""Errors raised by the ``envs`` package.

A bad *action* never raises out of :meth:`envs.core.AgentEnv.step`: it becomes an ``"Error: ..."`` observation.
These exceptions are for programming and set-up mistakes (unknown env ids, a missing sandbox tool) and for the
internal plumbing that turns a bad action into that observation.
"""

from __future__ import annotations


class EnvError(Exception):
    """Base class of every error raised by ``envs``."""


class UnknownEnvError(EnvError, KeyError):
    """An environment id that is not registered (a ``KeyError``, so ``except KeyError`` keeps working)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        # KeyError.__str__ would quote the message like a dict key; show it as a sentence instead.
        return self.message


class ActionError(EnvError, ValueError):
    """An action string that is not a valid canonical action, or names an unknown tool, or has bad arguments."""


class SandboxError(EnvError):
    """A sandbox could not be created or used (missing bubblewrap, closed sandbox, path escaping the workdir)."""


class VerifierError(EnvError):
    """A reward/verifier function failed. It propagates out of ``step``/``astep`` so that the caller marks the
    trajectory ``error`` with this message; a failed verifier never becomes a reward of 0."""


class EnvCrashedError(RuntimeError):
    """The environment's backend (a browser, an X server, a desktop app) died mid-episode.

    Deliberately not an :class:`EnvError`: ``AgentEnv.step`` turns ``EnvError`` into an ``"Error: ..."`` observation,
    but a dead backend cannot continue the episode. It propagates, so the caller marks the trajectory ``error`` with
    this message as the reason; the env's pool replaces the backend at the next reset.
    """
