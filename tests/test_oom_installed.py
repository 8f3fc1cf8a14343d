"""OOM sites from an installed torchtop: the demos it ships are the job's code, not a library.

The package is built as a wheel and installed into a folder of its own, as ``pip install``
would (not editable), and ``torchtop demo oom`` runs from there on the emulated device. The
site that held the memory and the failing line must be the demo's lines, not torch's
``Sequential`` or ``Linear`` that a site-packages path would otherwise fall back to.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from torchtop.protocol import OutOfMemory
from torchtop.recording import read_recording

ROOT = Path(__file__).resolve().parent.parent
PIP = [sys.executable, "-m", "pip"]


@pytest.mark.slow
def test_the_oom_site_of_an_installed_demo_is_the_demos_line(tmp_path: Path) -> None:
    wheels, target = tmp_path / "wheels", tmp_path / "site"
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-build-isolation",
            "--no-deps",
            "-q",
            "-w",
            str(wheels),
            str(ROOT),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert build.returncode == 0, build.stderr
    (wheel,) = wheels.glob("torchtop-*.whl")
    install = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "-q",
            "--target",
            str(target),
            str(wheel),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert install.returncode == 0, install.stderr
    record = tmp_path / "oom.ttr"
    env = {
        **os.environ,
        "PYTHONPATH": str(target),
        "PYTHONWARNINGS": "ignore",
        "OMP_NUM_THREADS": "1",
        "TMPDIR": str(tmp_path),
    }
    command = [sys.executable, "-m", "torchtop", "demo", "oom", "--headless", "--quick"]
    proc = subprocess.run(
        [*command, "--record", str(record)],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        cwd=tmp_path,  # not the checkout: torchtop comes from the installed wheel
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    (oom,) = [m for m in read_recording(record).messages if isinstance(m, OutOfMemory)]
    demos = str(target / "torchtop" / "demos") + os.sep
    assert oom.top_sites, oom
    site = oom.top_sites[0]
    assert site.file.startswith(demos), site
    # The failing allocation's stack: torch's innermost frames for context, then the demo's.
    outside_torch = [f for f in oom.requested_stack if f"{os.sep}torch{os.sep}" not in f.file]
    assert outside_torch and outside_torch[0].file.startswith(demos), oom.requested_stack
