"""What every probe shares: the one exception a probe's ``read()`` may raise."""

from __future__ import annotations


class ProbeUnavailable(Exception):
    """The probe's source cannot be read at all, and reading again will not help.

    The message is the reason in words, for a person (for example ``"NVML not available:
    libnvidia-ml.so.1 not found"``). The sampler reports it once as a ``ProbeStatus`` and stops
    calling the probe. A value that merely could not be read this time is ``None`` instead.
    """
