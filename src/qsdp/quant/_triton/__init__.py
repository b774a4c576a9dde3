"""Triton backend of the quantizers (imported lazily: ``import qsdp`` never imports triton)."""
