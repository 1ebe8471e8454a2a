"""Every loss written as plainly as possible, from its paper: loops over anchors, float64.

These are the references the distributed losses are compared with on the
concatenated global batch; none of them is vectorised, gathered or tiled. Last, DINOv2's
Sinkhorn-Knopp and DINO's position-embedding interpolation as their repositories write them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def _unit(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=1, keepdim=True)


def _log_sum_exp(values: list[torch.Tensor]) -> torch.Tensor:
    return torch.log(sum(torch.exp(value) for value in values))


def ntxent(out0, out1, temperature: float) -> torch.Tensor:
    """SimCLR's NT-Xent: for each of the 2N views, the other view among all others."""
    z, pairs = _unit(torch.cat([out0, out1])), len(out0)
    terms = []
    for i in range(2 * pairs):
        positive = (i + pairs) % (2 * pairs)
        similarities = [z[i] @ z[j] / temperature for j in range(2 * pairs)]
        others = [s for j, s in enumerate(similarities) if j != i]
        terms.append(-similarities[positive] + _log_sum_exp(others))
    return torch.stack(terms).mean()


def dcl(out0, out1, temperature: float, weights: torch.Tensor | None = None) -> torch.Tensor:
    """DCL (Yeh et al., Eq. 6): the positive left out of the denominator; w_i on the positive."""
    z, pairs = _unit(torch.cat([out0, out1])), len(out0)
    terms = []
    for i in range(2 * pairs):
        positive = (i + pairs) % (2 * pairs)
        similarities = [z[i] @ z[j] / temperature for j in range(2 * pairs)]
        negatives = [s for j, s in enumerate(similarities) if j not in (i, positive)]
        weight = 1.0 if weights is None else weights[i % pairs]
        terms.append(-weight * similarities[positive] + _log_sum_exp(negatives))
    return torch.stack(terms).mean()


def dclw(out0, out1, temperature: float, sigma: float) -> torch.Tensor:
    """DCLW: DCL with w_i = 2 - N softmax_i(z0_i . z1_i / sigma) over all N pairs."""
    z0, z1 = _unit(out0), _unit(out1)
    with torch.no_grad():
        similarity = torch.stack([z0[i] @ z1[i] / sigma for i in range(len(z0))])
        weights = 2 - len(z0) * torch.softmax(similarity, dim=0)
    return dcl(out0, out1, temperature, weights)


def supcon(out0, out1, labels, temperature: float) -> torch.Tensor:
    """SupCon's L_out: mean over positives (same label, other views) outside the log."""
    z, pairs = _unit(torch.cat([out0, out1])), len(out0)
    views_labels = torch.cat([labels, labels]).tolist()
    terms = []
    for i in range(2 * pairs):
        similarities = [z[i] @ z[j] / temperature for j in range(2 * pairs)]
        others = [s for j, s in enumerate(similarities) if j != i]
        positives = [
            s for j, s in enumerate(similarities) if j != i and views_labels[j] == views_labels[i]
        ]
        terms.append(_log_sum_exp(others) - sum(positives) / len(positives))
    return torch.stack(terms).mean()


def infonce(features0, features1, logit_scale) -> torch.Tensor:
    """CLIP: cross-entropy of each row and each column of the scaled similarity matrix."""
    pairs, terms = len(features0), []
    for i in range(pairs):
        row = [logit_scale * features0[i] @ features1[j] for j in range(pairs)]
        column = [logit_scale * features1[i] @ features0[j] for j in range(pairs)]
        terms.append(_log_sum_exp(row) - row[i])
        terms.append(_log_sum_exp(column) - column[i])
    return torch.stack(terms).mean()


def mnrl(
    anchors, positives, *negatives, scale: float, symmetric: bool = False, identities=None
) -> torch.Tensor:
    """Multiple-negatives ranking: each anchor's cross-entropy over every positive and hard
    negative (cosine similarity times ``scale``), its own positive the target; with
    ``symmetric``, averaged with each positive's cross-entropy over every anchor.
    ``identities`` (``[column][row]`` texts' ids): a candidate other than the positive
    whose id is the positive's is left out (in reverse, an anchor whose id is the anchor's)."""
    a, p = _unit(anchors), _unit(positives)
    columns = (p, *(_unit(n) for n in negatives))
    candidates = [(column, j, x[j]) for column, x in enumerate(columns, 1) for j in range(len(x))]

    def kept(i: int, column: int, j: int, own: int) -> bool:
        same = identities is not None and identities[column][j] == identities[own][i]
        return (column == own and j == i) or not same

    terms = []
    for i in range(len(a)):
        row = [scale * a[i] @ c for column, j, c in candidates if kept(i, column, j, 1)]
        term = _log_sum_exp(row) - scale * a[i] @ p[i]
        if symmetric:
            back = [scale * p[i] @ a[j] for j in range(len(a)) if kept(i, 0, j, 0)]
            term = 0.5 * (term + _log_sum_exp(back) - scale * p[i] @ a[i])
        terms.append(term)
    return torch.stack(terms).mean()


def gist(anchors, positives, guides, temperature: float, margin: float = 0.0) -> torch.Tensor:
    """GISTEmbed with both contrasts and an absolute margin: each anchor's cross-entropy
    over every positive, every anchor and (its positive's row) every positive's
    similarity to its positive, divided by ``temperature``, leaving out each candidate
    but the positive whose guide similarity (``guides``: the two columns' guide
    embeddings) exceeds the positive's minus ``margin``."""
    a, p = _unit(anchors), _unit(positives)
    ga, gp = (_unit(g) for g in guides)
    terms = []
    for i in range(len(a)):
        threshold = ga[i] @ gp[i] - margin
        row = [a[i] @ p[j] for j in range(len(p)) if j == i or ga[i] @ gp[j] <= threshold]
        row += [a[i] @ a[j] for j in range(len(a)) if ga[i] @ ga[j] <= threshold]
        row += [p[i] @ p[j] for j in range(len(p)) if gp[i] @ gp[j] <= threshold]
        terms.append(_log_sum_exp([x / temperature for x in row]) - a[i] @ p[i] / temperature)
    return torch.stack(terms).mean()


class RankOffsetMNRL(torch.nn.Module):
    """sentence-transformers' ``gather_across_devices=True`` restated: candidates gathered
    with their gradient, the mean over this rank's anchors, and each anchor's positive at
    ``rank * n + i``: right only when every rank holds n rows (the control)."""

    def __init__(self, scale: float = 20.0) -> None:
        super().__init__()
        self.scale = scale

    def forward(self, anchors, positives, *negatives):
        import torch.distributed as dist

        from contrastive_accelerate import collectives

        rank = dist.get_rank() if dist.is_initialized() else 0
        a = _unit(anchors)
        candidates = torch.cat([collectives.gather(_unit(x)) for x in (positives, *negatives)])
        logits = self.scale * a @ candidates.T
        targets = rank * len(a) + torch.arange(len(a))
        if len(a) == 0:
            return logits.sum()
        return F.cross_entropy(logits, targets)


def siglip(features0, features1, logit_scale, logit_bias) -> torch.Tensor:
    """SigLIP: a binary sigmoid loss on every pair, +1 on the diagonal, -1 elsewhere."""
    pairs, total = len(features0), 0
    for i in range(pairs):
        for j in range(pairs):
            label = 1.0 if i == j else -1.0
            logit = logit_scale * features0[i] @ features1[j] + logit_bias
            total = total - F.logsigmoid(label * logit)
    return total / pairs


def _batch_statistics(z: torch.Tensor, unbiased: bool) -> tuple[torch.Tensor, torch.Tensor]:
    count = len(z)
    mean = torch.stack([sum(z[i, k] for i in range(count)) / count for k in range(z.shape[1])])
    squares = [sum((z[i, k] - mean[k]) ** 2 for i in range(count)) for k in range(z.shape[1])]
    return mean, torch.stack(squares) / (count - 1 if unbiased else count)


def barlow_twins(z_a, z_b, lambda_param: float, eps: float = 1e-5) -> torch.Tensor:
    """Barlow Twins: batch-standardised embeddings (biased variance, as BatchNorm), then the
    cross-correlation's diagonal pulled to 1 and off-diagonal to 0."""
    count, dim = z_a.shape
    mean_a, var_a = _batch_statistics(z_a, unbiased=False)
    mean_b, var_b = _batch_statistics(z_b, unbiased=False)
    a = (z_a - mean_a) / torch.sqrt(var_a + eps)
    b = (z_b - mean_b) / torch.sqrt(var_b + eps)
    loss = 0
    for k in range(dim):
        for m in range(dim):
            correlation = sum(a[i, k] * b[i, m] for i in range(count)) / count
            loss = loss + ((1 - correlation) ** 2 if k == m else lambda_param * correlation**2)
    return loss


def vicreg(z_a, z_b, lambda_param: float, mu_param: float, nu_param: float, eps: float):
    """VICReg: invariance (mean squared error), variance hinge on the std, off-diagonal
    covariance, with unbiased batch statistics."""
    count, dim = z_a.shape
    invariance = ((z_a - z_b) ** 2).sum() / (count * dim)
    variance = covariance = 0
    for z in (z_a, z_b):
        mean, var = _batch_statistics(z, unbiased=True)
        variance = variance + 0.5 * torch.relu(1 - torch.sqrt(var + eps)).mean()
        centred = z - mean
        for k in range(dim):
            for m in range(dim):
                if k != m:
                    cov = sum(centred[i, k] * centred[i, m] for i in range(count)) / (count - 1)
                    covariance = covariance + cov**2 / dim
    return lambda_param * invariance + mu_param * variance + nu_param * covariance


def koleo(x, eps: float = 1e-8) -> torch.Tensor:
    """KoLeo: minus the mean log distance from each unit row to its nearest other row,
    the nearest by Euclidean distance (the same as by cosine for unit rows); torch's
    ``pairwise_distance`` adds ``eps`` to the difference."""
    z = F.normalize(x, dim=1, eps=eps)
    total = 0
    for i in range(len(z)):
        distances = [(z[i] - z[j]).norm() if j != i else math.inf for j in range(len(z))]
        nearest = min(range(len(z)), key=lambda j: float(distances[j]))
        total = total - torch.log((z[i] - z[nearest] + eps).norm() + eps)
    return total / len(z)


def sinkhorn_knopp_teacher(teacher_output, teacher_temperature: float, iterations: int = 3):
    """DINOv2's ``SinkhornKnoppTeacher`` on one process (``dinov2/loss/dino_clstoken_loss.py``),
    as its repository writes it."""
    q = torch.exp(teacher_output / teacher_temperature).t()
    batch, prototypes = q.shape[1], q.shape[0]
    q /= torch.sum(q)
    for _ in range(iterations):
        q /= torch.sum(q, dim=1, keepdim=True)
        q /= prototypes
        q /= torch.sum(q, dim=0, keepdim=True)
        q /= batch
    q *= batch
    return q.t()


class MaskingGenerator:
    """DINOv2's ``MaskingGenerator`` (``dinov2/data/masking.py``, from BEiT), as its
    repository writes it, on ``random``'s global generator and a torch mask."""

    def __init__(self, input_size, num_masking_patches=None, min_num_patches=4,
                 max_num_patches=None, min_aspect=0.3, max_aspect=None):  # fmt: skip
        self.height, self.width = input_size
        self.num_masking_patches = num_masking_patches
        self.min_num_patches = min_num_patches
        self.max_num_patches = num_masking_patches if max_num_patches is None else max_num_patches
        max_aspect = max_aspect or 1 / min_aspect
        self.log_aspect_ratio = (math.log(min_aspect), math.log(max_aspect))

    def add_one_block(self, mask, max_mask_patches):  # DINOv2 names it _mask
        import random

        delta = 0
        for _ in range(10):
            target_area = random.uniform(self.min_num_patches, max_mask_patches)
            aspect_ratio = math.exp(random.uniform(*self.log_aspect_ratio))
            h = int(round(math.sqrt(target_area * aspect_ratio)))
            w = int(round(math.sqrt(target_area / aspect_ratio)))
            if w < self.width and h < self.height:
                top = random.randint(0, self.height - h)
                left = random.randint(0, self.width - w)
                num_masked = mask[top : top + h, left : left + w].sum()
                if 0 < h * w - num_masked <= max_mask_patches:
                    for i in range(top, top + h):
                        for j in range(left, left + w):
                            if mask[i, j] == 0:
                                mask[i, j] = 1
                                delta += 1
            if delta > 0:
                break
        return delta

    def __call__(self, num_masking_patches=0):
        mask = torch.zeros((self.height, self.width), dtype=torch.bool)
        mask_count = 0
        while mask_count < num_masking_patches:
            max_mask_patches = num_masking_patches - mask_count
            max_mask_patches = min(max_mask_patches, self.max_num_patches)
            delta = self.add_one_block(mask, max_mask_patches)
            if delta == 0:
                break
            mask_count += delta
        return mask


def dinov2_collate_masks(batch_size: int, grid, ratio=(0.1, 0.5), probability=0.5):
    """The masks DINOv2's ``collate_data_and_cast`` draws for one batch, from ``random``'s
    global generator: the first ``probability`` of the batch at ratios spread over
    ``ratio``, the rest unmasked, then shuffled."""
    import random

    n_tokens = grid[0] * grid[1]
    generator = MaskingGenerator(grid, max_num_patches=0.5 * n_tokens)
    n_masked = int(batch_size * probability)
    probs = torch.linspace(*ratio, n_masked + 1)
    upperbound, masks = 0, []
    for i in range(n_masked):
        masks.append(
            generator(int(n_tokens * random.uniform(float(probs[i]), float(probs[i + 1]))))
        )
        upperbound += int(n_tokens * float(probs[i + 1]))
    for _ in range(n_masked, batch_size):
        masks.append(generator(0))
    random.shuffle(masks)
    return torch.stack(masks)


def dino_interpolate_pos_encoding(pos_embed, width: int, height: int, patch_size: int):
    """DINO's ``VisionTransformer.interpolate_pos_encoding`` (facebookresearch/dino,
    ``vision_transformer.py``) for an input of ``width x height`` pixels."""
    npatch = (width // patch_size) * (height // patch_size)
    N = pos_embed.shape[1] - 1
    if npatch == N and width == height:
        return pos_embed
    class_pos_embed = pos_embed[:, 0]
    patch_pos_embed = pos_embed[:, 1:]
    dim = pos_embed.shape[-1]
    w0 = width // patch_size
    h0 = height // patch_size
    w0, h0 = w0 + 0.1, h0 + 0.1
    patch_pos_embed = F.interpolate(
        patch_pos_embed.reshape(1, int(math.sqrt(N)), int(math.sqrt(N)), dim).permute(0, 3, 1, 2),
        scale_factor=(w0 / math.sqrt(N), h0 / math.sqrt(N)),
        mode="bicubic",
    )
    assert int(w0) == patch_pos_embed.shape[-2] and int(h0) == patch_pos_embed.shape[-1]
    patch_pos_embed = patch_pos_embed.permute(0, 2, 3, 1).view(1, -1, dim)
    return torch.cat((class_pos_embed.unsqueeze(0), patch_pos_embed), dim=1)
