"""Where a stand-alone shard (`pslab server`) gets the job secret its workers must hold.

    --secret-file FILE given, FILE exists   read it: a regular file (not a link) of mode 0600 or stricter
    --secret-file FILE given, FILE missing  create it (mode 0600) holding a new secret
    no flag, PSLAB_JOB_SECRET[_FILE] set    use that (as every other pslab process does)
    neither                                 a new secret in <tmp>/pslab-secret-XXXX/job-secret (directory 0700,
                                            removed when the server exits)

The file's path goes into the server's start-up line; workers read it via PSLAB_JOB_SECRET_FILE.
"""

from __future__ import annotations

import os
import tempfile

from pslab.collectives.auth import read_private_file
from pslab.collectives.errors import AuthError

from .admission import check_secret, job_secret, new_job_secret
from .errors import ConfigError


def read_secret_file(path: str) -> str:
    """The secret in `path`, which must be a regular file readable by its owner only."""
    try:
        data = read_private_file(path, f"--secret-file {path}")
    except AuthError as e:
        raise ConfigError(str(e)) from None
    try:
        return check_secret(data)
    except ConfigError as e:
        raise ConfigError(f"--secret-file {path}: {e}") from None


def write_secret_file(path: str) -> str:
    """Create `path` (mode 0600, must not exist) holding a new secret; returns the secret."""
    secret = new_job_secret()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    except OSError as e:
        raise ConfigError(f"--secret-file {path}: cannot create it ({e.strerror})") from None
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")
    return secret


def server_secret(path: str | None) -> tuple[str, str, str | None]:
    """(secret, where it is -- for the start-up line, the temp directory made for it or None)."""
    if path is not None:
        if os.path.lexists(path):
            return read_secret_file(path), path, None
        return write_secret_file(path), f"{path} (new)", None
    secret = job_secret()
    if secret is not None:
        where = "PSLAB_JOB_SECRET" if os.environ.get("PSLAB_JOB_SECRET") else \
            f"PSLAB_JOB_SECRET_FILE={os.environ.get('PSLAB_JOB_SECRET_FILE')}"
        return secret, where, None
    made = tempfile.mkdtemp(prefix="pslab-secret-")       # mode 0700
    file = os.path.join(made, "job-secret")
    return write_secret_file(file), f"{file} (new; workers: PSLAB_JOB_SECRET_FILE={file})", made
