"""Contrastive and redundancy-reduction losses, exact on any number of processes.

Each returns this rank's share of the loss of the *global* batch: the mean of the
returned values over ranks is the single-process loss, and DDP's gradient average is
the single-process gradient, uneven batches and idle ranks included. Their
collectives live in ``contrastive_accelerate.collectives``.
"""

from losses.clip import InfoNCELoss, SigLIPLoss
from losses.dcl import DCLLoss, DCLWLoss
from losses.ntxent import NTXentLoss
from losses.redundancy import BarlowTwinsLoss, VICRegLoss
from losses.supcon import SupConLoss

__all__ = [
    "BarlowTwinsLoss",
    "DCLLoss",
    "DCLWLoss",
    "InfoNCELoss",
    "NTXentLoss",
    "SigLIPLoss",
    "SupConLoss",
    "VICRegLoss",
]
