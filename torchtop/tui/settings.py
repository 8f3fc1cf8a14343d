"""What the viewer remembers between runs (the theme), in a small JSON file of the user's.

``$XDG_CONFIG_HOME/torchtop/viewer.json`` (``~/.config/torchtop/viewer.json`` without it), in a
0700 folder, the file 0600 like every file torchtop writes. A file that cannot be read or
written never stops the viewer: it starts with the defaults and says so in the log.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from textual import log

from torchtop.private_files import open_private

FILE_NAME = "viewer.json"


def config_dir() -> Path:
    """The user's torchtop configuration folder (XDG base directories)."""
    base = os.environ.get("XDG_CONFIG_HOME") or ""
    root = Path(base) if os.path.isabs(base) else Path.home() / ".config"
    return root / "torchtop"


def settings_path() -> Path:
    return config_dir() / FILE_NAME


def load_settings() -> dict[str, Any]:
    """The saved settings; empty when there are none or they cannot be read."""
    path = settings_path()
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        log.warning(f"ignored {path}: {exc}")
        return {}
    return data if isinstance(data, dict) else {}


def save_setting(name: str, value: object) -> bool:
    """Remember ``name = value`` beside the other settings; False if it could not be written."""
    settings = load_settings()
    if settings.get(name) == value:
        return True
    settings[name] = value
    path = settings_path()
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        with open_private(path) as file:
            file.write(json.dumps(settings, indent=1).encode() + b"\n")
    except OSError as exc:
        log.warning(f"could not save {path}: {exc}")
        return False
    return True
