"""The Textual viewer: one App (:mod:`torchtop.tui.app`) and its screens, its panels
(:mod:`torchtop.tui.widgets`), and the viewer's units (:mod:`torchtop.tui.format`).

May import: Textual and rich, the shared ground, :mod:`torchtop.model` (every figure it shows)
and :mod:`torchtop.streams` (where its messages come from). Never torch, never the agent.
Imported only by :mod:`torchtop.commands`. Neighbours: the text and JSON renderings of the same
model are :mod:`torchtop.report`; the frames' sources are :mod:`torchtop.streams`.
"""
