"""Export a job's figures to the engines platform teams run: Prometheus (pull) and OpenTelemetry
(push).

Served from the torchtop process outside the job (``torchtop run --metrics``, ``torchtop
export``), never from a training rank. May import: the shared ground, :mod:`torchtop.model`,
:mod:`torchtop.streams` (the feeds it follows) and ``prometheus_client``; OpenTelemetry only when
``--otlp`` is given. Never torch, Textual or rich. Neighbours: the figures are computed by
:mod:`torchtop.model`; the text and JSON renderings are :mod:`torchtop.report`; the verb is in
:mod:`torchtop.commands`.
"""
