"""Gradient-correct all-gather and contrastive losses for distributed training."""

from losses.distributed import GatherLayer, all_gather_sizes, gather, is_distributed
from losses.ntxent import NTXentLoss

__all__ = ["GatherLayer", "NTXentLoss", "all_gather_sizes", "gather", "is_distributed"]
