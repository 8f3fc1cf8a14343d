"""The viewer's screens, in its one app (:class:`torchtop.tui.app.TorchtopApp`): a job's
(:mod:`.job`), a run's ranks (:mod:`.run`), the picker of running agents (:mod:`.picker`), and
the screens a job opens: the OOM screen (:mod:`.oom`), the advice (:mod:`.advice`), the help
(:mod:`.help`) and the question before quitting a job torchtop started (:mod:`.quit`).

May import: Textual, rich, :mod:`torchtop.tui.widgets`, :mod:`torchtop.tui.format`, the model and
the streams' :class:`~torchtop.streams.source.Source`; never torch or the agent, and never the
app itself (a screen reaches it as ``self.app``, through a narrow Protocol where it needs more).
Neighbours: the panels are :mod:`torchtop.tui.widgets`; what feeds a screen is
:mod:`torchtop.streams`.
"""
