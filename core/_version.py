"""clusterwire's version: a leaf module, so that any module may name it (``clusterwire``
re-exports it) without importing the package root, which imports them."""

__version__ = "0.1.0"
