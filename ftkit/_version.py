"""The one version of ftkit (``setup.cfg`` reads it; ``ftkit.__version__`` is it)."""
__version__ = "0.1.0"
