"""Adapters for the frameworks that build FSDP2 or DDP themselves: each hands the model they
prepared to :func:`qsdp.compress_fsdp` or :func:`qsdp.ddp.register` and does nothing else.

- :mod:`qsdp.integrations.hf`: Hugging Face ``accelerate.Accelerator`` and
  ``transformers.Trainer`` (``pip install 'qsdp[hf]'``).
- :mod:`qsdp.integrations.lightning`: Lightning's ``Trainer`` under ``DDPStrategy`` or
  ``ModelParallelStrategy`` (FSDP2), one callback (``pip install 'qsdp[lightning]'``).
- :mod:`qsdp.integrations.torchtitan`: torchtitan 0.3's ``Trainer`` (FSDP2, FSDP2 + TP),
  selected with ``--override.imports`` (``pip install 'qsdp[torchtitan]'``).

Importing this package imports no framework: import the adapter's module itself.
"""

__all__: list[str] = []
