"""The set-up gives torch what it needs: importing it in the venv prints no warning."""

from __future__ import annotations

import subprocess
import sys


def test_torch_imports_without_warnings() -> None:
    out = subprocess.run(
        [sys.executable, "-W", "default", "-c", "import torch; torch.zeros(2).numpy()"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "Failed to initialize NumPy" not in out.stderr
    assert "Warning" not in out.stderr, out.stderr
