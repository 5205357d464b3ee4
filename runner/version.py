"""The ckrun version (``ckrun.__version__``), recorded in every checkpoint's compat block."""

__version__ = "0.1.0"
