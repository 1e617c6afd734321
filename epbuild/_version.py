"""epbuild's version (a bottom module: every layer may ask it)."""

__version__ = "0.1.0"
