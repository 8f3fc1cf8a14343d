"""Which modules hold the activation memory of a training step: a measurement for one step.

Between :meth:`ActivationWindow.begin` and :meth:`ActivationWindow.end`, both called in the
training thread at step boundaries, torch's global module forward pre/post hooks keep the stack
of running modules, and a ``saved_tensors_hooks`` pack hook sees every tensor autograd saves
for backward. Each saved storage counts once (the first module that saves it), parameters'
storages never (they are weights, not activations), under the innermost running module. What
autograd saves is what a step's forward leaves held at its peak (the start of backward), so
the bytes per module are the activation memory it holds there; they agree with torch's
``MemTracker`` (``torch.distributed._tools.mem_tracker``) per block to within a block's input
against its output (``tests/unit/test_activations.py``).

Cost: a Python call per module call and per saved tensor, in that step only; the hooks are
removed at :meth:`end`. The op windows take one over their first step
(``torchtop.agent.ops.sampler``): it goes in and out at step boundaries, where the job has no
saved-tensor hooks of its own open, and never in a job that compiled a graph (the hooks would
change what torch.compile traced).
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass
from typing import Any

#: Modules listed in a result, at most.
TOP = 5
#: A module holding at least this share of the total is looked into: its children are listed.
DESCEND_SHARE = 0.9


@dataclass(frozen=True)
class ModuleActivations:
    """Activation bytes held by one module (its submodules included) at the step's peak."""

    path: str
    bytes: int
    share: float


class ActivationWindow:
    """One step's activation memory by module; ``begin`` and ``end`` in the training thread."""

    def __init__(self) -> None:
        self._stack: list[str] = []
        self._names: dict[int, str] = {}
        self._roots: set[str] = set()
        self._weights: set[tuple[str, int]] = set()
        self._seen: set[tuple[str, int]] = set()
        #: Bytes saved for backward under each innermost module path (``Root.child.leaf``; ""
        #: outside any module).
        self.own: dict[str, int] = {}
        self._undo: list[Any] = []
        self._thread = 0

    @property
    def total(self) -> int:
        """Bytes saved for backward in all (outside the job's modules too)."""
        return sum(self.own.values())

    def begin(self) -> None:
        import torch
        from torch.nn.modules import module as nn_module

        self._thread = threading.get_ident()
        pre = nn_module.register_module_forward_pre_hook(self._pre)
        post = nn_module.register_module_forward_hook(self._post, always_call=True)
        saved = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        saved.__enter__()

        def leave() -> None:
            # Torch's saved-tensor hooks are a stack: pop only if ours is on top (else the
            # job opened its own meanwhile; ours stays, counting nothing, never theirs popped).
            top = torch._C._autograd._top_saved_tensors_default_hooks(False)
            if top is not None and top[0] == self._pack:
                saved.__exit__(None, None, None)

        self._undo = [pre.remove, post.remove, leave]

    def end(self, top: int = TOP) -> list[ModuleActivations]:
        """Remove the hooks; the top modules (see :func:`top_modules`)."""
        self._thread = -1  # whatever stays in place counts nothing from now on
        for undo in reversed(self._undo):
            undo()
        self._undo = []
        return top_modules(self.own, top)

    # -- the hooks (the training thread) ------------------------------------------------------

    def _pre(self, module: Any, args: Any) -> None:
        if threading.get_ident() != self._thread:
            return
        name = self._names.get(id(module))
        if name is None:
            if self._stack:  # a module its parent did not list (made in forward): by class
                name = f"{self._stack[-1]}.{type(module).__name__}"
            else:  # a root: name its tree after its class, as MemTracker does; know its weights
                name = type(module).__name__
                if name in self._roots:
                    name = f"{name}#{len(self._roots) + 1}"
                self._roots.add(name)
                for path, child in module.named_modules():
                    self._names[id(child)] = f"{name}.{path}" if path else name
                for param in module.parameters():
                    self._weights.add(_key(param))
            self._names[id(module)] = name
        self._stack.append(name)

    def _post(self, module: Any, args: Any, output: Any) -> None:
        if threading.get_ident() == self._thread and self._stack:
            self._stack.pop()

    def _pack(self, tensor: Any) -> Any:
        try:
            if threading.get_ident() == self._thread and not tensor.is_sparse:
                key = _key(tensor)
                if key not in self._seen and key not in self._weights:
                    self._seen.add(key)
                    path = self._stack[-1] if self._stack else ""
                    nbytes = tensor.untyped_storage().nbytes()
                    self.own[path] = self.own.get(path, 0) + nbytes
        except Exception:  # an odd tensor: not counted, never the job's failure
            pass
        return tensor


def _unpack(tensor: Any) -> Any:
    return tensor


def compiled_in_use() -> bool:
    """Whether the job has compiled a graph with torch.compile (no measurement then)."""
    utils = sys.modules.get("torch._dynamo.utils")
    try:
        return utils is not None and utils.counters["stats"]["unique_graphs"] > 0
    except Exception:
        return True


def _key(tensor: Any) -> tuple[str, int]:
    return (str(tensor.device), tensor.untyped_storage().data_ptr())


def inclusive(own: dict[str, int]) -> dict[str, int]:
    """Each module's bytes with its submodules' (paths ``a.b.c`` add to ``a.b`` and ``a``; the
    root is ``""``)."""
    out: dict[str, int] = {}
    for path, nbytes in own.items():
        parts = path.split(".") if path else []
        for depth in range(len(parts) + 1):
            prefix = ".".join(parts[:depth])
            out[prefix] = out.get(prefix, 0) + nbytes
    return out


def top_modules(own: dict[str, int], top: int = TOP) -> list[ModuleActivations]:
    """The modules that hold the activations: starting at the root, while one child holds at
    least :data:`DESCEND_SHARE` of the total, look into it; then its children, largest first
    (a transformer's layers rather than the one ``layers`` list that holds them all)."""
    totals = inclusive(own)
    total = totals.get("", 0)
    if total <= 0:
        return []
    parent = ""
    while True:
        children = _children(totals, parent)
        if not children:
            break
        largest = max(children, key=lambda path: totals[path])
        if totals[largest] < DESCEND_SHARE * total or not _children(totals, largest):
            break
        parent = largest
    children = _children(totals, parent) or [parent]
    ranked = sorted(children, key=lambda path: (-totals[path], path))[:top]
    return [ModuleActivations(path, totals[path], totals[path] / total) for path in ranked]


def _children(totals: dict[str, int], parent: str) -> list[str]:
    depth = parent.count(".") + 1 if parent else 0
    return [
        path
        for path in totals
        if path and (not parent or path.startswith(parent + ".")) and path.count(".") == depth
    ]
