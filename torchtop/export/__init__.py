"""Export a job's figures to the engines platform teams run: Prometheus (pull) and OpenTelemetry
(push).

Served from the torchtop process outside the job (``torchtop run --metrics``, ``torchtop
export``), never from a training rank. Standard library and ``prometheus_client`` only;
OpenTelemetry is imported only when ``--otlp`` is given. Never imports torch.
"""
