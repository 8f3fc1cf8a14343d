"""Reading torch's events (sampler thread): a profiler result's events copied into plain
:class:`~torchtop.agent.ops.aggregation.Event` s, and the job's own call sites told from the
libraries' (``--profile-stack``)."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from torchtop.agent.ops.aggregation import MATMUL_OPS, Event


def _shapes(value: Any) -> str | None:
    if not value:
        return None
    if all(not shape for shape in value):
        return None
    return ", ".join("[" + ", ".join(str(d) for d in shape) + "]" for shape in value)


#: kineto's activity types of torch's own events (``CPU_OP``, ``USER_ANNOTATION``): their
#: correlation id is torch's op id, which kernels and runtime calls link to.
TORCH_OP_ACTIVITIES = (0, 1)


def _runtime_call(name: str) -> bool:
    """A CUDA or HIP runtime or driver call, by its name (``cudaLaunchKernel``,
    ``cuLaunchKernel``, ``hipMemcpyAsync``): for a torch with no ``activity_type``."""
    return name.startswith(("cuda", "hip")) or (name.startswith("cu") and name[2:3].isupper())


def read_events(
    result: Any,
    *,
    record_shapes: bool,
    links: bool = True,
    python: bool = False,
    dtypes: bool = False,
) -> list[Event]:
    """Copy a ``_ProfilerResult``'s events into :class:`Event` s.

    Each method call on torch's event costs a fraction of a microsecond and a window may hold
    thousands of events, so only what is needed is read: correlations (``links``) only when
    device activity was recorded, Python frames (``python``) only with ``--profile-stack``,
    the input dtype (``dtypes``, a window that recorded inputs) only of :data:`MATMUL_OPS`.
    """
    from torch.autograd import DeviceType

    raw_events = result.events()
    if not raw_events:
        return []
    first = raw_events[0]
    has_ns = hasattr(first, "start_ns")  # torch 2.0: microseconds only
    has_hidden = hasattr(first, "is_hidden_event")
    has_annotation = hasattr(first, "is_user_annotation")  # torch 2.1 on
    has_activity = links and hasattr(first, "activity_type")
    python = python and hasattr(first, "is_python_function")
    cpu_type = DeviceType.CPU
    out: list[Event] = []
    append = out.append
    for raw in raw_events:
        if has_hidden and raw.is_hidden_event():
            continue
        device = raw.device_type() != cpu_type
        # A range of record_function on the device's timeline (``Optimizer.step#AdamW.step``
        # around the kernels it launched) is no op: its time is its kernels' time, counted
        # already. torch's own tables leave it out of device time too.
        if device and has_annotation and raw.is_user_annotation():
            continue
        if has_ns:
            start = raw.start_ns()
            end = raw.end_ns()
        else:
            start = int(raw.start_us() * 1000)
            end = start + int(raw.duration_us() * 1000)
        is_python = python and raw.is_python_function()
        name = raw.name()
        dtype = None
        if dtypes and name in MATMUL_OPS:
            inputs = raw.dtypes()
            dtype = str(inputs[0]) if inputs and inputs[0] else None
        append(
            Event(
                name=name,
                start=start,
                end=end,
                thread=raw.start_thread_id(),
                device=device,
                correlation=raw.correlation_id() if links else 0,
                linked=raw.linked_correlation_id() if links else 0,
                op=(
                    raw.activity_type() in TORCH_OP_ACTIVITIES
                    if has_activity
                    else not _runtime_call(name)
                ),
                python=is_python,
                shapes=_shapes(raw.shapes()) if record_shapes and not is_python else None,
                dtype=dtype,
            )
        )
    return out


def site_reader(exclude: Iterable[str]) -> Callable[[str], str | None]:
    """``site_of`` for :func:`aggregate`: a Python event's name (``file.py(12): fn``) when the
    file is the job's own, else ``None``.

    Library files are those under one of the ``exclude`` directories. The profiler names a
    file relative to the first of ``sys.path`` (and the site directories) that holds it, so a
    relative name is looked for under those, longest first, as torch made it.
    """
    prefixes = tuple(str(Path(p)) + os.sep for p in exclude)
    roots = _path_roots()
    cache: dict[str, str | None] = {}

    def resolve(path: str) -> str | None:
        if os.path.isabs(path):
            return path
        for root in roots:
            candidate = os.path.join(root, path)
            if os.path.exists(candidate):
                return candidate
        return None

    def site_of(name: str) -> str | None:
        if name in cache:
            return cache[name]
        site: str | None = None
        paren = name.find("(")
        if paren > 0 and not name.startswith("<"):
            path = resolve(name[:paren])
            if path is not None and not path.startswith(prefixes):
                site = f"{os.path.basename(path)}{name[paren:]}"
        cache[name] = site
        return site

    return site_of


def _path_roots() -> list[str]:
    """The directories torch's Python tracer strips from file names, longest first."""
    import site

    raw = list(sys.path)
    with contextlib.suppress(Exception):
        raw += [*site.getsitepackages(), site.getuserbase(), site.getusersitepackages()]
    torch_file = getattr(sys.modules.get("torch"), "__file__", None)
    if isinstance(torch_file, str):
        raw.append(os.path.dirname(os.path.dirname(torch_file)))
    return sorted({os.path.abspath(p) for p in raw if isinstance(p, str)}, reverse=True)


def _library_dirs() -> list[str]:
    """Directories whose frames are never a call site: torch, torchtop, the standard library,
    installed packages."""
    import site

    dirs = [os.path.dirname(os.__file__)]
    for name in ("torch", "torchtop"):
        module = sys.modules.get(name)
        file = getattr(module, "__file__", None)
        if file:
            dirs.append(os.path.dirname(file))
    with contextlib.suppress(Exception):
        dirs.extend(site.getsitepackages())
        dirs.append(site.getusersitepackages())
    return dirs
