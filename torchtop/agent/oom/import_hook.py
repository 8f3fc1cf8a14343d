"""An import hook: a callback right after a module (``torch.cuda``) has been executed, so
that CUDA capture is armed as soon as the job imports torch, without importing it first."""

from __future__ import annotations

import contextlib
import importlib.abc
import sys
from collections.abc import Callable
from typing import Any


class _ArmAfterImport(importlib.abc.MetaPathFinder):
    """Runs ``callback(module)`` right after module ``name`` has been executed, once.

    It finds the module with the other finders and wraps only that module's loader instance
    for the one ``exec_module`` call, so the module keeps its own loader.
    """

    def __init__(self, name: str, callback: Callable[[Any], None]) -> None:
        self.name = name
        self.callback = callback

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        try:
            sys.meta_path.remove(self)
        except ValueError:
            return None
        spec = None
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            if find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                break
        loader = getattr(spec, "loader", None)
        original = getattr(loader, "exec_module", None)
        if original is None:
            return spec
        callback = self.callback

        def exec_module(module: Any) -> None:
            try:
                original(module)
            finally:
                try:
                    del loader.exec_module  # type: ignore[union-attr]
                except AttributeError:
                    pass
            with contextlib.suppress(Exception):
                callback(module)

        try:
            loader.exec_module = exec_module  # type: ignore[union-attr]
        except (AttributeError, TypeError):
            pass  # the worker thread arms it once torch is imported
        return spec


def _arm_after_import(name: str, callback: Callable[[Any], None]) -> None:
    if name in sys.modules:
        callback(sys.modules[name])
        return
    sys.meta_path.insert(0, _ArmAfterImport(name, callback))
