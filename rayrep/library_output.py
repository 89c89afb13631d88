"""Where library output goes: the terminal keeps rayrep's own lines (progress, plans, tables),
and what libraries repeat in every actor (vLLM's CPU-backend notices, torch's and Python's
warnings, weight-loading progress bars, C++ notices) goes to a log file of the run.

The driver names the file in each actor's environment (`LIBRARY_LOG_ENV`, set through the
actor's Ray `runtime_env` by `rayrep.cluster.placement.Placement.options`); the actor calls
`route_library_output` first thing. Standard library only, so that any role can import it.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

LIBRARY_LOG_ENV = "RAYREP_LIBRARY_LOG"
LIBRARY_LOG = "libraries.log"
"""The file's name in a run's folder."""


def library_log_env(folder) -> dict[str, str]:
    """The environment variable that sends an actor's library output to `folder`/libraries.log."""
    return {LIBRARY_LOG_ENV: str(Path(folder).resolve() / LIBRARY_LOG)}


def route_library_output() -> str | None:
    """Send this process's stdout and stderr to the file `$RAYREP_LIBRARY_LOG` names
    (appended), at the level of file descriptors, so that output from C++ and from
    libraries' own handlers goes there too. Log records at ERROR and above still reach the
    original stderr, which Ray forwards to the driver's terminal; so do exceptions, which
    reach the driver with the calls that raise them. Returns the file, or None (and changes
    nothing) where the variable is unset: in the driver, or an actor started outside a run.
    """
    path = os.environ.get(LIBRARY_LOG_ENV)
    if not path:
        return None
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    terminal = os.fdopen(os.dup(2), "w", buffering=1)
    sys.stdout.flush()
    sys.stderr.flush()
    log = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    errors = logging.StreamHandler(terminal)
    errors.setLevel(logging.ERROR)
    errors.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logging.getLogger().addHandler(errors)
    logging.captureWarnings(True)  # warnings.warn goes through logging: into the file, once per place
    return path
