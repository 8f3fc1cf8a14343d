"""The out-of-memory flow: capture at the moment of failure, explain it, save it, and pause.

On CUDA, :class:`OomController` has the caching allocator record its history (bounded:
``torch.cuda.memory._record_memory_history(max_entries=N, stacks="python", context="alloc")``)
and attaches an out-of-memory observer. Both are installed through ``torch.cuda._lazy_call``,
so they take effect when the job itself initializes CUDA, before its first allocation, and the
agent never initializes CUDA on its own. Recording is never switched off again:
``_record_memory_history(enabled=None)`` would leave the allocator's hooks behind.

The allocator calls the observer in the thread that failed, after it has given back what cache
it could and before it raises: the flow reads the snapshot there, so the live blocks are the
ones that caused the failure. Under ``--memory-limit`` the CPU emulation
(:mod:`torchtop.agent.memory_limit`) calls the same flow from its dispatch mode.

The flow: group the live blocks by the job's allocating line, tell *fragmented* from *full*,
save the snapshot (a pickle memory_viz opens), publish an ``oom`` event, and with
``--pause-on-oom`` hold the job until a viewer sends ``resume`` or the timeout passes. Then the
job's own ``OutOfMemoryError`` goes on unchanged: nothing here raises into the job.

A job may catch an OOM and retry: failures that reach the job for the same device and size
within :data:`REPEAT_WINDOW_S` of the last one published are published once (each is still
followed, so those torch handles are counted), and at most ``max_captures`` failures per run
are captured in full.

Viewer requests (``snapshot``, ``resume``) arrive on the server's I/O thread, which only hands
them over: a snapshot is taken in the controller's own worker thread.

May import: the shared ground and the rest of :mod:`torchtop.agent`; torch only inside functions
that run once the job has imported it. The live memory figures are :mod:`torchtop.agent.probes`;
the advice drawn from a capture is the model's (:mod:`torchtop.model.oom_advice`).

What lives where:

- :mod:`.controller`: :class:`OomController`, the flow, the CUDA setup and its worker thread.
- :mod:`.watch`: telling handled failures from those that reach the job (in the thread that
  failed, or after backward for failures in the autograd engine's threads).
- :mod:`.capture`: a snapshot analysed into a capture, and made small enough for one frame.
- :mod:`.import_hook`: a callback once the job has imported ``torch.cuda``.
"""

from torchtop.agent.oom.controller import PROBE_NAME, REPEAT_WINDOW_S, OomController

__all__ = ["PROBE_NAME", "REPEAT_WINDOW_S", "OomController"]
