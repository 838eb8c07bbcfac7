"""OmniBal-Megatron's training package: arguments, initialisation, the training loop, checkpoints.

``megatron/`` itself has no ``__init__.py``: it is a namespace package that merges with the
installed ``megatron.core`` (as Megatron-LM's ``megatron/training`` sits beside ``megatron/core``).
"""
