"""Everything between the agents and their consumers: finding agents and runs, following them,
and handing their frames on.

Here: the feed of one agent (:mod:`~torchtop.streams.feed`), the ranks of a run followed
together (:mod:`~torchtop.streams.runs`), the sources a viewer reads (live, a run, a recording,
a job watched from outside: :mod:`~torchtop.streams.source`, :mod:`~torchtop.streams.sources`,
:mod:`~torchtop.streams.outside`), the runner that starts a job under torchtop
(:mod:`~torchtop.streams.runner`), recordings (:mod:`~torchtop.streams.recording`), and the
relay that carries a node's agents to a viewer on another node (:mod:`~torchtop.streams.relay`,
:mod:`~torchtop.streams.nodes`, and the token both ends share, :mod:`~torchtop.streams.token`).

May import: the shared ground (``torchtop.protocol``, ``transport``, ``private_files``,
``sizes``, ``text``, ``launch``, ``job_output``), :mod:`torchtop.model` and
:mod:`torchtop.report`; the outside watch reads the agent's probes that work from outside a job.
Never Textual, rich or torch. Neighbours: the fold of frames into figures is
:mod:`torchtop.model`; the screens are :mod:`torchtop.tui`; the verbs that start all this are
:mod:`torchtop.commands`.
"""
