"""``torchtop demo``: run a bundled demo of one PyTorch practice, bad way against good way."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from torchtop.commands.core import (
    VERB_HELP,
    CliError,
    Subparsers,
    add_oom_options,
    add_ops_options,
    oom_agent_options,
    ops_agent_options,
)
from torchtop.commands.demo_catalog import DemoNotFound, find_demo, list_demos
from torchtop.commands.run import run_spec
from torchtop.sizes import parse_size
from torchtop.streams.runner import RunSpec


def add_parser(sub: Subparsers) -> argparse.ArgumentParser:
    demo = sub.add_parser(
        "demo",
        help=VERB_HELP["demo"],
        description="Run a demo: the same job done the slow way and the fast way, measured.",
    )
    demo.add_argument("name", nargs="?", help="the demo to run (see --list)")
    demo.add_argument("--list", action="store_true", help="list the demos")
    demo.add_argument("--json", action="store_true", help="with --list: print JSON")
    demo.add_argument(
        "--source", action="store_true", help="print the demo's source instead of running it"
    )
    demo.add_argument("--quick", action="store_true", help="a short run (for CI)")
    demo.add_argument(
        "--device", choices=("cpu", "cuda"), help="where to run (default: cuda when available)"
    )
    demo.add_argument("--headless", action="store_true", help="no viewer: print the measured table")
    demo.add_argument("--record", metavar="FILE", type=Path, help="save the stream to FILE")
    add_oom_options(demo)
    add_ops_options(demo)
    return demo


def run(args: argparse.Namespace) -> int:

    if args.list or not args.name:
        demos = list_demos()
        if args.json:
            print(
                json.dumps(
                    [{"name": d.name, "description": d.description} for d in demos], indent=2
                )
            )
            return 0
        width = max(len(d.name) for d in demos) if demos else 0
        print("demos (run one with `torchtop demo NAME`, add --headless for a table):")
        for d in demos:
            print(f"  {d.name:<{width}}  {d.description}")
        return 0
    try:
        demo = find_demo(args.name)
    except DemoNotFound as exc:
        raise CliError(str(exc)) from None
    if args.source:
        print(demo.path.read_text(), end="")
        return 0

    demo_args = []
    if args.quick:
        demo_args.append("--quick")
    device = args.device
    if device == "cuda" and _default_device() == "cpu":
        raise CliError(NO_CUDA)  # before the job starts: one line, not the demo's
    agent_options = {**oom_agent_options(args), **ops_agent_options(args)}
    if demo.cpu_memory_limit is not None and args.memory_limit is None:
        # A demo that runs out of memory on purpose (oom) gets an emulated device on the CPU,
        # never the machine's RAM; on CUDA it meets the GPU's real limit.

        device = device or _default_device()
        if device == "cpu":
            agent_options["memory_limit_bytes"] = parse_size(demo.cpu_memory_limit)
    if device:
        demo_args += ["--device", device]
    spec = RunSpec(
        target=["-m", demo.module, *demo_args],
        agent_options=agent_options,
        headless=args.headless,
        record=args.record,
    )
    return run_spec(spec)


#: ``--device cuda`` where torch finds no GPU (the CLI's line, and a demo's run on its own).
NO_CUDA = (
    "this PyTorch sees no CUDA GPU: run the demo with --device cpu, or install a CUDA build of "
    "torch (`torchtop doctor` says which build this is)"
)


def _default_device() -> str | None:
    """The demos' default device as the job's Python sees it: "cuda" when torch finds a GPU,
    else "cpu" (``None`` if it cannot tell). Asked in a child process: the CLI never imports
    torch."""

    probe = "import torch; print('cuda' if torch.cuda.is_available() else 'cpu')"
    try:
        proc = subprocess.run(
            [sys.executable, "-W", "ignore", "-c", probe],
            capture_output=True,
            text=True,
            timeout=120,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    answer = proc.stdout.strip().splitlines()[-1:] if proc.returncode == 0 else []
    return answer[0] if answer and answer[0] in ("cpu", "cuda") else None
