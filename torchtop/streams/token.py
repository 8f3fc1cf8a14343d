"""The token of a TCP relay: written by the relay (``torchtop relay --listen``), read by the
viewer that connects to it (``torchtop attach --node``, :mod:`torchtop.streams.nodes`). Below both
ends, so that neither imports the other for it."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from torchtop.private_files import UnsafeFile, open_private, read_private

#: A token torchtop makes has this many random bytes; a token file must hold this many
#: characters at least (22 URL-safe base64 characters carry 128 bits).
TOKEN_BYTES = 32
MIN_TOKEN_CHARS = 22


class RelayError(Exception):
    """The relay cannot start or serve; the message says why and what to do."""


def read_token(path: Path) -> str:
    """The token in ``path``, which must be the user's own file (not a link, not another
    user's) with no access for others."""
    try:
        data, mode = read_private(path)
        text = data.decode().strip()
    except FileNotFoundError:
        raise RelayError(
            f"no token file at {path}: give the file the relay wrote (it printed where)"
        ) from None
    except UnsafeFile as exc:
        raise RelayError(f"cannot read the token file {path}: {exc.strerror}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise RelayError(f"cannot read the token file {path}: {exc}") from None
    if mode & 0o077:
        raise RelayError(
            f"the token file {path} is open to other users (mode "
            f"{mode:o}): `chmod 600 {path}`, or a new token is needed"
        )
    if len(text) < MIN_TOKEN_CHARS:
        raise RelayError(
            f"the token in {path} is shorter than {MIN_TOKEN_CHARS} characters: delete the "
            "file and let `torchtop relay --listen` write a new one"
        )
    return text


def token_for(path: Path) -> tuple[str, bool]:
    """The relay's token: the one in ``path``, or a new random one written there (0600);
    and whether it is new."""
    if os.path.lexists(path):
        return read_token(path), False
    token = secrets.token_urlsafe(TOKEN_BYTES)
    try:
        with open_private(path) as f:
            f.write(token.encode() + b"\n")
    except OSError as exc:
        raise RelayError(f"cannot write the token file {path}: {exc.strerror}") from None
    return token, True
