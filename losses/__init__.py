"""Contrastive and redundancy-reduction losses, exact on any number of processes.

Each returns this rank's share of the loss of the *global* batch: the mean of the
returned values over ranks is the single-process loss, and DDP's gradient average is
the single-process gradient, uneven batches and idle ranks included. Their
collectives live in ``contrastive_accelerate.collectives``.

Every ``forward`` also takes ``sizes=`` (keyword), every rank's number of samples when
the caller knows them, as ``trainer.py``'s sampler does: the loss then exchanges
nothing and reads no device value, and leaves value checks to the caller
(``losses.inputs``; a ``ShareSizes`` collects a rank's wrong row count for the caller's
next check). Without it, the sizes are exchanged and bad input raises a
``ValueError`` on every rank at once.
"""

from contrastive_accelerate.collectives import ShareSizes
from losses.clip import InfoNCELoss, SigLIPLoss
from losses.dcl import DCLLoss, DCLWLoss
from losses.dino import DINOLoss
from losses.distillation import DistillationLoss
from losses.gist import GISTEmbedLoss
from losses.ibot import IBOTPatchLoss
from losses.koleo import KoLeoLoss
from losses.matryoshka import MatryoshkaLoss
from losses.momentum import MoCoLoss, NegativeCosineSimilarityLoss
from losses.ntxent import NTXentLoss
from losses.ranking import MultipleNegativesRankingLoss
from losses.redundancy import BarlowTwinsLoss, VICRegLoss
from losses.sinkhorn import sinkhorn_knopp
from losses.supcon import SupConLoss
from losses.swav import SwAVLoss

__all__ = [
    "BarlowTwinsLoss",
    "DCLLoss",
    "DCLWLoss",
    "DINOLoss",
    "DistillationLoss",
    "GISTEmbedLoss",
    "IBOTPatchLoss",
    "InfoNCELoss",
    "KoLeoLoss",
    "MatryoshkaLoss",
    "MoCoLoss",
    "MultipleNegativesRankingLoss",
    "NegativeCosineSimilarityLoss",
    "NTXentLoss",
    "ShareSizes",
    "SigLIPLoss",
    "SupConLoss",
    "SwAVLoss",
    "VICRegLoss",
    "sinkhorn_knopp",
]
