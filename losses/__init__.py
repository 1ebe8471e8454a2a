"""Gradient-correct collectives and contrastive losses, exact on any number of processes."""

from losses.clip import InfoNCELoss, SigLIPLoss
from losses.dcl import DCLLoss, DCLWLoss
from losses.distributed import (
    AllReduceLayer,
    GatherLayer,
    all_gather_sizes,
    all_reduce,
    gather,
    is_distributed,
)
from losses.ntxent import NTXentLoss
from losses.redundancy import BarlowTwinsLoss, VICRegLoss
from losses.supcon import SupConLoss

__all__ = [
    "AllReduceLayer",
    "BarlowTwinsLoss",
    "DCLLoss",
    "DCLWLoss",
    "GatherLayer",
    "InfoNCELoss",
    "NTXentLoss",
    "SigLIPLoss",
    "SupConLoss",
    "VICRegLoss",
    "all_gather_sizes",
    "all_reduce",
    "gather",
    "is_distributed",
]
