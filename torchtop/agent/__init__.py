"""The in-process agent: what runs inside the training job. It reads the job's numbers (memory,
steps, DataLoaders, ops, output), serves them as protocol frames on a socket, and handles an
out-of-memory failure as it happens.

May import: the shared ground, :mod:`torchtop.agent.probes`, and torch, but torch only once the
agent is started, never on import (``import torchtop`` stays cheap). Never Textual, rich, the
model, the streams or the viewer. Neighbours: what reads the agent's socket is
:mod:`torchtop.streams`; the fold of its frames into figures is :mod:`torchtop.model`; starting
an agent in a job that runs without one is :mod:`torchtop.attach`. ``rank_site/`` is not a
package: it is the folder ``torchtop run`` puts first on a job's ``PYTHONPATH``, so that its
``sitecustomize`` starts an agent in each rank.
"""
