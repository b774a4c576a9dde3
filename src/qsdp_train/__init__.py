"""Runnable jobs behind the ``qsdp`` command (nothing in the library imports this package)."""
