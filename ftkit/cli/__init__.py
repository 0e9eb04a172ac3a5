"""The ``ftkit`` console script (``ftkit.cli.main:main``).

Importing this package imports neither mpi4py nor torch, so the CLI runs on a login node.
"""
