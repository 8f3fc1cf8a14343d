"""Text and JSON renderings of the model: a job's report (:mod:`~torchtop.report.job`), a run's
ranks side by side (:mod:`~torchtop.report.run`), and the few lines printed when a job ends
(:mod:`~torchtop.report.exit_summary`).

May import: :mod:`torchtop.model` and the shared ground. Never Textual, rich or torch. The model
computes every figure; this package only lays them out. Neighbours: the live screens are
:mod:`torchtop.tui`; the exporters' renderings are :mod:`torchtop.export`.
"""
