"""Package discovery; everything else is in pyproject.toml.

pyproject's ``packages.find`` cannot find a package whose folder is mapped elsewhere, and the
demos live in ``demos/`` but ship as ``torchtop.demos``: so the packages are found here, by
rule, never listed by hand.
"""

from setuptools import find_packages, setup

setup(
    packages=[
        *find_packages(include=["torchtop", "torchtop.*"]),
        "torchtop.demos",
        *(f"torchtop.demos.{name}" for name in find_packages("demos")),
    ]
)
