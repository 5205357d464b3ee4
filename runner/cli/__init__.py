"""The ``ckrun`` command line: the click group and one module per family of commands.

``main`` is the console-script entry point (``ckrun = ckrun.cli:main``).
"""

from ckrun.cli.main import main

__all__ = ["main"]
