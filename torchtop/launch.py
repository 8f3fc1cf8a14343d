"""How torchtop starts Python processes of its own (the job's bootstrap, the detached copy of a
job's output). Standard library only.

``python -m MODULE`` puts the current directory first on ``sys.path``, so a ``torchtop/`` folder
in the directory a job starts from would be imported in place of torchtop. Our children leave
the current directory out: ``-P`` on Python 3.11+, and on 3.10 a one-line ``-c`` that drops it
before running the module as ``-m`` would. The one exception is a torchtop that was itself
imported from the current directory (run from a checkout): the child finds the same one.
"""

from __future__ import annotations

import os
import sys

#: The 3.10 stand-in for ``-P -m MODULE``: ``-c`` puts ``''`` (the current directory) first.
_WITHOUT_CWD = (
    "import runpy, sys; del sys.path[0]; "
    "runpy.run_module(sys.argv.pop(1), run_name='__main__', alter_sys=True)"
)


def python_module(module: str) -> list[str]:
    """The command that runs ``module`` as ``__main__`` without the current directory on
    ``sys.path``; its arguments follow."""
    ours = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if os.path.realpath(ours) == os.path.realpath(os.getcwd()):
        return [sys.executable, "-m", module]  # this very torchtop is the current directory's
    if sys.version_info >= (3, 11):
        return [sys.executable, "-P", "-m", module]
    return [sys.executable, "-c", _WITHOUT_CWD, module]
