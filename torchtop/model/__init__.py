"""The model: protocol messages folded into the state of each job, and the queries on it.

Feed a :class:`JobModel` every message of one job's stream, live or from a recording, with
:meth:`JobModel.apply` (and the source events of :mod:`torchtop.model.connection`); read it at
any time. A :class:`RunModel` holds the models of several jobs side by side. The viewer, the
report and the exporters read the model, so a figure is computed once and is the same number
everywhere.

May import: the standard library, itself and the shared ground (in practice
:mod:`torchtop.protocol` and :mod:`torchtop.text`); no I/O. Neighbours: the frames come from
:mod:`torchtop.streams`; they are shown by :mod:`torchtop.tui`, written out by
:mod:`torchtop.report` and exported by :mod:`torchtop.export`.
"""

from __future__ import annotations

from torchtop.model.captures import CaptureEntry, MemoryCaptures
from torchtop.model.connection import SourceConnected, SourceDisconnected, SourceStatus
from torchtop.model.job import JobIdentity, JobModel, LogEntry, Mark, Phase
from torchtop.model.memory import DeviceMemory
from torchtop.model.ops import OpTimings, UnavailablePeriod
from torchtop.model.run import RunModel
from torchtop.model.training import StepPoint, StepTotals, TrainingState, weighted_quantile

__all__ = [
    "CaptureEntry",
    "DeviceMemory",
    "JobIdentity",
    "JobModel",
    "LogEntry",
    "Mark",
    "MemoryCaptures",
    "OpTimings",
    "Phase",
    "RunModel",
    "SourceConnected",
    "SourceDisconnected",
    "SourceStatus",
    "StepPoint",
    "StepTotals",
    "TrainingState",
    "UnavailablePeriod",
    "weighted_quantile",
]
