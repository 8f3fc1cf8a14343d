"""Probes: each reads one source of numbers for the sampler thread."""
