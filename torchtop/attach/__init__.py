"""Injection: start an agent inside a running Python process that was started without torchtop
(:mod:`torchtop.attach.inject`), for ``torchtop attach``.

May import: the shared ground only; never torch, Textual or rich (the code it runs in the job is a
string, and the agent it starts is :mod:`torchtop.agent`). Neighbours: where injection is
refused, the job is watched from outside by :mod:`torchtop.streams.outside`; the verb that
chooses between the two is in :mod:`torchtop.commands`.
"""
