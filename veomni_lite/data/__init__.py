"""Synthetic datasets, the shift-once collator and the layout-independent micro-batch loader."""

from veomni_lite.data.collator import collate
from veomni_lite.data.datasets import SyntheticTextDataset, SyntheticVLMDataset
from veomni_lite.data.loader import MicroBatchLoader

__all__ = ["MicroBatchLoader", "SyntheticTextDataset", "SyntheticVLMDataset", "collate"]
