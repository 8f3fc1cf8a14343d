"""The viewer's screens, in its one app (:class:`torchtop.tui.app.TorchtopApp`): a job's
(:mod:`.job`), a run's ranks (:mod:`.run`), the picker of running agents (:mod:`.picker`), and
the screens a job opens: the OOM screen (:mod:`.oom`), the advice (:mod:`.advice`), the help
(:mod:`.help`) and the question before quitting a job torchtop started (:mod:`.quit`)."""
