"""Files torchtop writes are private to the user: mode 0600, whatever the umask. Standard library
only.

Recordings, op-timing traces, job logs and agent descriptions hold argv, cwd, hostname and the
job's whole output, so no other user may read them. Every write site opens through here.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

PRIVATE_MODE = 0o600


def open_private(path: str | os.PathLike[str]) -> BinaryIO:
    """``open(path, "wb")``, created 0600; an existing file is truncated and made 0600 too."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, PRIVATE_MODE)
    try:
        os.fchmod(fd, PRIVATE_MODE)  # an existing file keeps its mode through open()
        return os.fdopen(fd, "wb")
    except BaseException:
        os.close(fd)
        raise


@contextmanager
def written_privately(path: str | os.PathLike[str]) -> Iterator[Path]:
    """A path for a library that writes a file its own way (torch's trace export): it lies in a
    fresh 0700 folder beside ``path``, so no one else can open it meanwhile; when the block ends
    without error it becomes ``path``, 0600, at once. On error nothing is left."""
    target = Path(path)
    folder = tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        partial = Path(folder) / target.name
        yield partial
        os.chmod(partial, PRIVATE_MODE)
        os.replace(partial, target)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
