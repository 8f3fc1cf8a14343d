"""Entry point of the job under ``torchtop run``: start the agent, then run the user's code.

``python -m torchtop.agent.bootstrap SCRIPT [ARGS...]`` or ``... -m MODULE [ARGS...]``. The
agent's options arrive as JSON in ``TORCHTOP_AGENT_OPTIONS``, removed from the environment before
the user's code runs so that processes the job starts do not inherit them. The script runs as
``__main__`` with the ``sys.argv``, ``sys.path[0]`` and (absolute) ``__file__`` it would have under
plain ``python``; its exit code and its own traceback come through unchanged, and on Ctrl-C it
ends as Python does: the job's frames only, then death by SIGINT. It is started by
:func:`torchtop.launch.python_module`, without the current directory on ``sys.path``, so the
script's directory (or, for ``-m``, the current directory) goes first, as plain ``python`` puts it.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
from types import TracebackType

OPTIONS_ENV = "TORCHTOP_AGENT_OPTIONS"
#: Exit code for a script or module that cannot be found (as ``python`` uses).
EXIT_NOT_FOUND = 2


def _exit_code(exc: SystemExit) -> int:
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    return 1  # `sys.exit("message")` prints the message and exits 1


def _user_frames(tb: TracebackType | None) -> TracebackType | None:
    """Drop the leading frames of this module and runpy so the traceback starts in user code."""
    ours = {
        os.path.abspath(__file__),
        os.path.abspath(runpy.__file__ or ""),
        "<frozen runpy>",
        "<string>",  # the launcher's `-c` on Python 3.10, before everything else
    }

    def is_ours(filename: str) -> bool:
        return filename in ours or os.path.abspath(filename) in ours

    while tb is not None and is_ours(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    return tb


def _print_job_traceback(exc: BaseException) -> None:
    """The job's own traceback, as plain `python` would print it, through any hook it set."""
    trimmed = _user_frames(exc.__traceback__)
    sys.excepthook(type(exc), exc.with_traceback(trimmed), trimmed)


def _already_printed(*_args: object) -> None:
    pass


def main(argv: list[str]) -> int:
    options = json.loads(os.environ.pop(OPTIONS_ENV, "{}") or "{}")
    if not argv or argv == ["-m"]:
        print("torchtop: nothing to run: give a script or -m MODULE", file=sys.stderr)
        return EXIT_NOT_FOUND
    module = None
    if argv[0] == "-m":
        module, args = argv[1], argv[2:]
    else:
        script, args = argv[0], argv[1:]
        if not os.path.isfile(script):
            print(f"torchtop: can't open file {script!r}: no such file", file=sys.stderr)
            return EXIT_NOT_FOUND

    # The job's own argv first: the agent describes the job by it.
    sys.argv = [module, *args] if module is not None else [script, *args]

    from torchtop.agent import core, rank_start

    rank_start.start(**options)

    if module is not None:
        import importlib.util

        sys.path.insert(0, os.getcwd())
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            print(f"torchtop: no module named {module!r}", file=sys.stderr)
            core.finish(EXIT_NOT_FOUND, f"no module named {module}")
            return EXIT_NOT_FOUND
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))

    try:
        if module is not None:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            # `python SCRIPT` makes __main__.__file__ absolute (tracebacks and warnings name it so).
            runpy.run_path(os.path.abspath(script), run_name="__main__")
    except SystemExit as exc:
        code = _exit_code(exc)
        if code != 0 and not isinstance(exc.code, int) and exc.code is not None:
            print(exc.code, file=sys.stderr)
        core.finish(code, f"exited with code {code}")
        return code
    except KeyboardInterrupt as exc:
        _print_job_traceback(exc)
        core.finish(130, "interrupted")
        # Uncaught at the top, KeyboardInterrupt makes Python run its exit handlers and then
        # die by SIGINT, so a shell's `cmd; next` stops as it does for plain python. Its
        # traceback is already printed, with the job's frames only.
        sys.excepthook = _already_printed
        raise KeyboardInterrupt from None
    except BaseException as exc:
        _print_job_traceback(exc)
        core.finish(1, f"uncaught {type(exc).__name__}: {exc}")
        return 1
    core.finish(0, "finished")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
