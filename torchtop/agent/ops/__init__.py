"""Op timings from sampled ``torch.profiler`` windows.

The profiler costs too much to leave on (a small model runs 1.5 times slower or worse), so
the agent samples it: a *window* of a step or two, then a pause long enough that the
windows' measured cost stays within a budget (0.5% by default). The profiler records the ops
of the thread that starts it, so windows open and close in the training thread, at step
boundaries: the sampler thread *arms* a window and the step hook of
:mod:`torchtop.agent.steps` opens it at the next boundary of the step clock and closes it
``window_steps`` boundaries later. Until then the hook costs one list lookup. A job with no
steps gets time-based windows, opened and closed between two bytecodes of the main thread
(``Py_AddPendingCall``).

Only starting and stopping the profiler happen in the training thread (well under a
millisecond each, measured per window). Reading the events, ranking the ops, counting sync
points and copies and writing the Chrome trace happen in the sampler thread.

The job's own profiler always wins: while it runs, no window opens; if it starts while one of
ours is open, ours is stopped first and thrown away, and the viewer is told "op timings
unavailable" until the job's profiler ends.

May import: the shared ground and the rest of :mod:`torchtop.agent`; torch only inside functions
that run once a window opens. The step clock the windows follow is :mod:`torchtop.agent.steps`;
the op table the viewer shows is the model's (:mod:`torchtop.model.ops`).

What lives where:

- :mod:`.aggregation`: plain events in, ranked ops and counts out (pure, no torch).
- :mod:`.torch_events`: reading torch's events into plain ones (sampler thread).
- :mod:`.profiler`: starting and stopping torch's profiler, and Kineto (training thread).
- :mod:`.main_thread`: calls into the main thread between two bytecodes (time-based windows).
- :mod:`.frames`: closed windows into ``ops`` frames, and what they cost the job (sampler
  thread).
- :mod:`.sections`: :func:`window` and :func:`paused`, around sections of the job's code.
- :mod:`.sampler`: :class:`OpsSampler`, which schedules the windows and opens and closes them.
"""

from torchtop.agent.ops.aggregation import Event, aggregate, merge, ranked
from torchtop.agent.ops.profiler import inside_torch_callback, quiet_kineto, records_inputs
from torchtop.agent.ops.sampler import (
    ARMED,
    IDLE,
    OPEN,
    OWN_PROFILER,
    PROBE,
    REFUSED_LIMIT,
    WAITING_FOR_CUDA,
    OpsSampler,
)
from torchtop.agent.ops.sections import paused, window
from torchtop.agent.ops.torch_events import read_events, site_reader

__all__ = [
    "ARMED",
    "IDLE",
    "OPEN",
    "OWN_PROFILER",
    "PROBE",
    "REFUSED_LIMIT",
    "WAITING_FOR_CUDA",
    "Event",
    "OpsSampler",
    "aggregate",
    "inside_torch_callback",
    "merge",
    "paused",
    "quiet_kineto",
    "ranked",
    "read_events",
    "records_inputs",
    "site_reader",
    "window",
]
