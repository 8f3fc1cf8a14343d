"""The verbs of the ``torchtop`` command, one module each (see ``torchtop.cli`` for the rest)."""
