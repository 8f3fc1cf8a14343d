"""Files torchtop writes are private to the user: mode 0600, whatever the umask. Standard library
only.

Recordings, op-timing traces, job logs and agent descriptions hold argv, cwd, hostname and the
job's whole output, so no other user may read them. Every write site opens through here, and no
write follows a symbolic link or lands in a file another user owns: a link or a file planted
where torchtop writes (in ``/tmp``, say) is refused and left as it is.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

PRIVATE_MODE = 0o600


class UnsafeFile(OSError):
    """A path torchtop will not write or read through; ``strerror`` says why and the fix."""


def _opened(path: str | os.PathLike[str], flags: int) -> int:
    """``os.open`` that follows no link at the last step, waits on no FIFO, and yields only a
    regular file of ours."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, PRIVATE_MODE)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeFile(
                errno.ELOOP,
                "it is a symbolic link (torchtop writes only to files of yours, never through a "
                "link): remove it, or choose another path",
            ) from None
        if exc.errno == errno.ENXIO:  # a FIFO with no reader
            raise _not_regular() from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise _not_regular()
        if info.st_uid != os.getuid():
            raise UnsafeFile(
                errno.EPERM,
                f"it belongs to {user_name(info.st_uid)}, not to you: remove it, or choose "
                "another path",
            )
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _not_regular() -> UnsafeFile:
    return UnsafeFile(errno.EPERM, "it is not a regular file: choose another path")


def user_name(uid: int) -> str:
    """The login name of ``uid``, or ``uid N`` when it has none."""
    import pwd

    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def open_private(path: str | os.PathLike[str]) -> BinaryIO:
    """``open(path, "wb")``, created 0600; an existing file (a regular file of ours, else
    :class:`UnsafeFile`) is truncated and made 0600 too."""
    fd = _opened(path, os.O_WRONLY | os.O_CREAT)
    try:
        os.ftruncate(fd, 0)  # after the checks: another user's file is never cut
        os.fchmod(fd, PRIVATE_MODE)  # an existing file keeps its mode through open()
        return os.fdopen(fd, "wb")
    except BaseException:
        os.close(fd)
        raise


def read_private(path: str | os.PathLike[str]) -> tuple[bytes, int]:
    """The content and mode of a regular file of ours at ``path``, not through a link
    (:class:`UnsafeFile` otherwise; ``FileNotFoundError`` when there is none)."""
    fd = _opened(path, os.O_RDONLY)
    with os.fdopen(fd, "rb") as f:
        return f.read(), stat.S_IMODE(os.fstat(f.fileno()).st_mode)


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
