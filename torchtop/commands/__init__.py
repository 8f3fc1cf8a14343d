"""The verbs of the ``torchtop`` command, one module each: the only place that imports the viewer
and starts the streams, the exporters and the reports.

May import: any torchtop package (never torch itself, so that ``torchtop --help`` stays fast).
Nothing imports this package but ``torchtop.__main__`` (and ``torchtop.cli``, the command line
whose verbs are moving here). Neighbours: the viewer is :mod:`torchtop.tui`; what runs and
follows jobs is :mod:`torchtop.streams`; the reports are :mod:`torchtop.report`.
"""
