"""The trainer behind the ``qsdp`` command (``python -m qsdp_train``): GPT, data, metrics,
plots, checkpoints. An application of the library: it imports only qsdp's public names, and
nothing in ``qsdp`` imports it (``tests/test_layering.py`` checks both)."""
