"""Energon datasets in the trainer: Megatron-Bridge's layout and this trainer's own, read with Energon's savable
loader per data-parallel rank (``stream.py``), the same records as the JSONL path (``record_sample.py``), and
``omnibal data to-energon`` (``convert.py``).  See docs/data.md."""
