"""The viewer's panels: one widget each (memory, steps, ops, log, host, device, loaders, header,
phase), and what they share (the chart, redrawing only on change).

May import: Textual and rich, :mod:`torchtop.model` and :mod:`torchtop.protocol`, and the
viewer's own :mod:`torchtop.tui.format`. A panel reads the model; it never computes a figure
the report or the exporters would need too (that is :mod:`torchtop.model`'s). Neighbours: the
App and the screens that lay the panels out are :mod:`torchtop.tui`.
"""
