"""Probes: each reads one source of numbers (the caching allocator, NVML, the host, a CPU job's
heap) for the agent's sampler thread.

May import: :mod:`torchtop.protocol` and psutil; torch and ``pynvml`` only inside a probe's
methods. A probe that works from outside a job (the host's, NVML's) is read by the outside watch
(:mod:`torchtop.streams.outside`) and ``torchtop doctor`` too. Neighbours: the thread that reads
them is :mod:`torchtop.agent.sampler`; the figures they become are :mod:`torchtop.model`.
"""
