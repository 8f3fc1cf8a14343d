"""``torchtop relay``: carry this node's agents to a viewer on another node."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from torchtop.commands.core import (
    VERB_HELP,
    CliError,
    Subparsers,
)
from torchtop.streams.relay import serve_stdio, serve_tcp
from torchtop.streams.token import RelayError


def add_parser(sub: Subparsers) -> argparse.ArgumentParser:
    relay = sub.add_parser(
        "relay",
        help=VERB_HELP["relay"],
        description="Serve this node's agents to a viewer elsewhere (`torchtop attach --node`): "
        "their frames, each tagged with its agent, new agents as they start. Without --listen "
        "it speaks on stdin/stdout, as `ssh HOST torchtop relay` runs it, and ends when they "
        "close; nothing listens. With --listen it serves TCP, only to viewers with its token: "
        "for trusted networks only, since the viewer cannot tell the relay from anyone else "
        "listening at that address (over ssh, the default, ssh authenticates both ends).",
    )
    relay.add_argument(
        "--run", metavar="ID", help="only the ranks of this run (default: every agent here)"
    )
    relay.add_argument(
        "--listen",
        metavar="[ADDR:]PORT",
        help="serve over TCP on ADDR:PORT (default ADDR 127.0.0.1, this machine only; another "
        "address, such as 0.0.0.0, only when named; PORT 0 takes a free one) until interrupted",
    )
    relay.add_argument(
        "--token-file",
        metavar="FILE",
        type=Path,
        help="with --listen: the token viewers must present, read from FILE (made there, "
        "0600, if missing; default: a new one in the runtime directory, relay-PORT.token)",
    )
    return relay


def run(args: argparse.Namespace) -> int:

    try:
        if args.listen is not None:
            return serve_tcp(args.listen, args.token_file, args.run)
        if args.token_file is not None:
            raise CliError("--token-file goes with --listen (over ssh, ssh authenticates)")
        if sys.stdin.isatty():
            raise CliError(
                "`torchtop relay` speaks to a viewer on its stdin and stdout: run `torchtop "
                "attach --node THIS_HOST` on the viewer's machine (it starts `ssh THIS_HOST "
                "torchtop relay`), or serve TCP with `torchtop relay --listen PORT`"
            )
        return serve_stdio(args.run)
    except RelayError as exc:
        raise CliError(str(exc), code=1) from None
