"""The model: protocol messages folded into the state of each job, and the queries on it.

Standard library and :mod:`torchtop.protocol` only; no I/O. The viewer, the report and the
exporters read it, so a figure is computed once and is the same number everywhere.
"""
