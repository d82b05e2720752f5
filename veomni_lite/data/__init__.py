"""Data plumbing of the library: the shift-once collator, the layout-independent loader, the micro-batch checks."""

from veomni_lite.data.checks import DataError, validate_micro_batch
from veomni_lite.data.collator import collate
from veomni_lite.data.loader import MicroBatchLoader

__all__ = ["DataError", "MicroBatchLoader", "collate", "validate_micro_batch"]
