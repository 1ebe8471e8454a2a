"""Text towers: a Hugging Face ``transformers`` encoder, pooled and projected.

``transformers`` is the optional ``[text]`` extra: this module imports it only when a
tower is loaded, so image-only runs never import it.

    encoder, tokenizer = load_text_encoder("path/to/bert")
    model = TextPairModel([TextTower(encoder, "mean")])         # one tower shared by every column
    embeddings = model([(input_ids, attention_mask)])           # one column, one row per text
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, NamedTuple

import torch
from torch import nn

from models.dropout import sample_randomness
from models.loading import first_line, load_auto_model, save_without_code
from models.lora import is_adapted, save_adapted
from models.vision import PretrainedImageModel

#: The poolings of a tower, sentence-transformers' modes: the first token, the masked mean
#: (its default), the masked maximum, the last token (decoder embedders'), the masked sum
#: over the square root of the length, and the mean weighted by position (SGPT's).
POOLINGS = ("cls", "mean", "max", "lasttoken", "mean_sqrt_len_tokens", "weightedmean")
#: ``--text-model scratch``: a small BERT from random weights, a word-level vocabulary.
SCRATCH = "scratch"
SCRATCH_SIZES = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                 "intermediate_size": 128}  # fmt: skip
SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
#: Subfolders of a saved ``TextPairModel``: each tower, and the sentence-transformers export.
TOWER_DIR, SENTENCE_TRANSFORMER_DIR = "tower{}", "sentence_transformer"
#: A tower's LoRA adapter (``models.lora``), beside its merged model in ``tower<i>/``.
ADAPTER_DIR = "adapter{}"
#: The subfolder of a saved ``ImageTextModel`` with a pretrained image tower.
IMAGE_DIR = "image"
#: ``whole(module)``: a context inside which ``module`` holds its weights (``save_exports``).
Whole = Callable[[nn.Module], AbstractContextManager]


class TextError(ValueError):
    """A text tower or tokenizer problem the user must fix: reported as one line."""


def load_text_encoder(
    name_or_path: str, dtype: torch.dtype = torch.float32, flag: str = "--text-model"
):
    """``AutoModel`` and ``AutoTokenizer`` from a local directory or the hub, from
    safetensors only and without remote code: loading never executes code. Raises
    ``TextError`` (naming ``flag``) for a missing ``transformers``, an unloadable model
    or a tokenizer without a pad token (the batches are padded)."""
    encoder = load_auto_model(name_or_path, dtype, flag, TextError)
    import transformers

    try:
        # False, not None: with None, transformers asks on standard input whether to run
        # a folder's own code (auto_map), and runs it on "y".
        tokenizer = transformers.AutoTokenizer.from_pretrained(
            name_or_path, trust_remote_code=False
        )
    except Exception as error:  # transformers raises many types; the user needs one line
        raise TextError(f"cannot load {flag} {name_or_path!r}: {first_line(error)}") from None
    freeze_pooler(encoder)
    if tokenizer.pad_token_id is None:
        raise TextError(
            f"the tokenizer of {flag} {name_or_path!r} has no pad token; set one "
            "(tokenizer.pad_token = ...) and save it again"
        )
    return encoder, tokenizer


def scratch_text_encoder(texts: Sequence[str], max_length: int, dtype: torch.dtype):
    """A small BERT (``SCRATCH_SIZES``) with random weights, drawn from torch's generator
    (seed it alike on every rank), and a word-level tokenizer whose vocabulary is every
    lower-cased word of ``texts`` in sorted order: nothing is downloaded, and the
    vocabulary is the same on every rank (no trainer's tie-breaking)."""
    try:
        import transformers
        from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    except ImportError:
        raise TextError(
            "--text-model scratch needs transformers: pip install -e '.[text]'"
        ) from None
    normalizer, splitter = (
        normalizers.BertNormalizer(lowercase=True),
        pre_tokenizers.BertPreTokenizer(),
    )
    words = sorted(
        {
            word
            for text in texts
            for word, _ in splitter.pre_tokenize_str(normalizer.normalize_str(text))
        }
    )
    vocabulary = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *words])}
    tokenizer = Tokenizer(models.WordLevel(vocabulary, unk_token="[UNK]"))
    tokenizer.normalizer, tokenizer.pre_tokenizer = normalizer, splitter
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        special_tokens=[("[CLS]", vocabulary["[CLS]"]), ("[SEP]", vocabulary["[SEP]"])],
    )
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
        sep_token="[SEP]", mask_token="[MASK]",
    )  # fmt: skip
    config = transformers.BertConfig(
        vocab_size=len(vocabulary), max_position_embeddings=max_length, **SCRATCH_SIZES
    )
    encoder = transformers.BertModel(config).to(dtype)  # a pooler, as AutoModel loads it back
    freeze_pooler(encoder)
    return encoder, fast


def freeze_pooler(encoder: nn.Module) -> None:
    """Freeze a BERT-style pooler: our pooling replaces it, so it would take no gradient
    (which DDP refuses) and only weight decay. It stays in the model, with the weights it
    was loaded (or, missing there, initialised from the run's seed) with, so that the
    saved tower and its sentence-transformers export load whole: ``AutoModel`` adds a
    pooler to every BERT, and one missing from the files would be drawn at random."""
    pooler = getattr(encoder, "pooler", None)
    if pooler is not None:
        pooler.requires_grad_(False)


class TextTower(nn.Module):
    """A ``transformers`` encoder, its last hidden states pooled as sentence-transformers'
    ``Pooling`` does (``cls``: the first token's; ``mean``: the mean over the attention
    mask's tokens; ``max``: their maximum; ``lasttoken``: the last one's), then a
    sentence-transformers folder's ``dense`` layers (``models.sentence_folder``), with
    ``projection_dim`` a linear projection (with bias), and with ``normalize`` unit length.

    Padding does not change a text's embedding: attention masks keep pad tokens out of
    attention and pooling (the batches pad on the right). ``use_attention_mask=False`` is
    the negative control.
    """

    def __init__(
        self,
        encoder: nn.Module,
        pooling: str = "mean",
        projection_dim: int | None = None,
        *,
        use_attention_mask: bool = True,
        dense: nn.Sequential | None = None,
        normalize: bool = False,
    ) -> None:
        super().__init__()
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
        self.encoder, self.pooling = encoder, pooling
        self.use_attention_mask, self.normalize = use_attention_mask, normalize
        self.dense = dense
        width = self.dense_dim
        self.projection = nn.Linear(width, projection_dim) if projection_dim else None

    @property
    def dense_dim(self) -> int:
        """The width after pooling and the ``dense`` layers."""
        linears = [m for m in self.dense or () if isinstance(m, nn.Linear)]
        return linears[-1].out_features if linears else self.encoder.config.hidden_size

    @property
    def output_dim(self) -> int:
        return self.projection.out_features if self.projection else self.dense_dim

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        if len(input_ids) == 0:
            # An idle rank (an uneven last batch): transformers' encoders cannot run on no
            # rows, yet DDP needs every parameter in this rank's graph. One row, kept none.
            one_row = input_ids.new_zeros((1, 1)), attention_mask.new_ones((1, 1))
            with sample_randomness(torch.zeros(1, dtype=torch.int64, device=input_ids.device)):
                return self(*one_row)[:0]
        mask = attention_mask if self.use_attention_mask else None
        hidden = self.encoder(input_ids=input_ids, attention_mask=mask).last_hidden_state
        pooled = pool(hidden, attention_mask, self.pooling)
        if self.dense is not None:
            pooled = self.dense(pooled)
        if self.projection is not None:
            pooled = self.projection(pooled)
        return torch.nn.functional.normalize(pooled, dim=-1) if self.normalize else pooled


def pool(hidden: torch.Tensor, attention_mask: torch.Tensor, pooling: str) -> torch.Tensor:
    """Token states ``(n, L, d)`` as one row each, as sentence-transformers' ``Pooling``
    computes them, the padding (on the right, mask 0) left out."""
    if pooling == "cls":
        return hidden[:, 0]
    weights = attention_mask.to(hidden.dtype).unsqueeze(-1)
    if pooling == "weightedmean":  # token t of the row weighs t (1-based)
        positions = torch.arange(1, hidden.shape[1] + 1, dtype=hidden.dtype, device=hidden.device)
        weights = weights * positions.unsqueeze(-1)
    if pooling in ("mean", "weightedmean"):
        return (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1.0)
    if pooling == "mean_sqrt_len_tokens":
        return (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1.0).sqrt()
    if pooling == "max":
        return hidden.masked_fill(weights == 0, torch.finfo(hidden.dtype).min).amax(dim=1)
    last = (attention_mask.sum(dim=1) - 1).clamp(min=0)  # lasttoken
    return hidden[torch.arange(len(hidden), device=hidden.device), last]


class TextPairModel(nn.Module):
    """The towers of a text-text run: ``towers[0]`` embeds the anchors, ``towers[-1]``
    every other column (one tower: shared; two: asymmetric query and document towers).

    ``forward(columns, keys)`` embeds each column, ``(input_ids, attention_mask)``, with
    its tower and returns the rows column after column. ``keys[c]``, one per row, key
    column c's dropout masks (``models.sample_randomness``); one call per chunk, so a
    DDP-wrapped model runs one forward per step or chunk.
    """

    def __init__(
        self,
        towers: Sequence[TextTower],
        tokenizers: Sequence[Any] = (),
        max_length: int | None = None,
        prompts: dict[str, str] | None = None,
    ) -> None:
        super().__init__()
        if len(towers) not in (1, 2):
            raise ValueError(f"TextPairModel takes one or two towers, got {len(towers)}")
        if len({tower.output_dim for tower in towers}) != 1:
            raise ValueError("the towers embed into different widths: give them a projection")
        self.towers = nn.ModuleList(towers)
        self.tokenizers = list(tokenizers)  # saved beside each tower, not trained
        self.max_length = max_length
        #: Each column's prompt, by column name (``--prompts``): what the texts were
        #: trained with, which the sentence-transformers export names.
        self.prompts = dict(prompts or {})

    def tower(self, column: int) -> TextTower:
        return self.towers[0] if column == 0 else self.towers[-1]

    def project_texts(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, column: int = 0
    ) -> torch.Tensor:
        """Texts of ``column`` through its tower: the evaluation's call (a method of the
        root, which a sharded model's forward hooks wrap: ``sharding.EVALUATION_CALLS``)."""
        return self.tower(column)(input_ids, attention_mask)

    def forward(
        self,
        columns: Sequence[tuple[torch.Tensor, torch.Tensor]],
        keys: Sequence[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        outputs = []
        for column, (input_ids, attention_mask) in enumerate(columns):
            randomness = (
                sample_randomness(keys[column]) if keys is not None else contextlib.nullcontext()
            )
            with randomness:
                outputs.append(self.tower(column)(input_ids, attention_mask))
        return torch.cat(outputs)

    def save_pretrained(self, directory: str) -> None:
        """``model.safetensors`` (every weight, as checkpoints hold them), then
        ``save_exports``."""
        save_weights(self, directory)
        self.save_exports(directory)

    def save_exports(self, directory: str, whole: Whole = contextlib.nullcontext) -> None:
        """Each tower's encoder and tokenizer through ``save_pretrained`` in ``tower0/``
        (and ``tower1/``), which ``AutoModel`` and ``AutoTokenizer`` load; and a
        sentence-transformers directory (``sentence_transformer/``: Transformer, Pooling,
        Dense, and for two towers a query/document ``Router``) when that package is
        installed. Each tower is written inside ``whole(tower)``: a sharded model's final
        save (``contrastive_accelerate.final_model``) fills one tower at a time."""
        heads = save_towers(directory, self.towers, self.tokenizers,
                            {"max_length": self.max_length}, whole)  # fmt: skip
        if len(self.tokenizers) == len(self.towers):
            export_sentence_transformer(
                heads,
                [os.path.join(directory, TOWER_DIR.format(i)) for i in range(len(self.towers))],
                os.path.join(directory, SENTENCE_TRANSFORMER_DIR),
                self.max_length,
                self.prompts,
            )


class ImageTextProjections:
    """The evaluation's calls of an image-text model whose ``image`` and ``text`` give
    the projections (``TextPairModel.project_texts`` says why they are methods)."""

    def project_images(self, images: torch.Tensor) -> torch.Tensor:
        return self.image(images)

    def project_texts(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, column: int = 0
    ) -> torch.Tensor:
        """The captions' projections (the one text column)."""
        return self.text(input_ids, attention_mask)


class ImageTextModel(ImageTextProjections, nn.Module):
    """CLIP's two towers (Radford et al., 2021): an image encoder with its projection head
    (``models.SimCLR``), a ``TextTower`` with a projection into the same width, and a
    learnable logit scale (``log_logit_scale``, CLIP's 1/0.07 at start, clamped at 100 by
    the method after each step) and, for SigLIP, a bias.

    ``forward(images, columns, keys)`` returns the image projections, then the caption
    column's; ``keys`` (images', captions') key each tower's dropout by sample.
    ``embed(images)`` is the image encoder's features, which the kNN evaluation uses.
    """

    def __init__(
        self,
        image: nn.Module,
        text: TextTower,
        tokenizer: Any = None,
        *,
        logit_scale: float = 1 / 0.07,
        logit_bias: float | None = None,
        max_length: int | None = None,
    ) -> None:
        super().__init__()
        self.image, self.text = image, text
        self.log_logit_scale = nn.Parameter(torch.tensor(math.log(logit_scale)))
        self.logit_bias = None if logit_bias is None else nn.Parameter(torch.tensor(logit_bias))
        self.tokenizer, self.max_length = tokenizer, max_length

    def embed(self, images: torch.Tensor) -> torch.Tensor:
        return self.image.embed(images)

    def forward(
        self,
        images: torch.Tensor,
        columns: Sequence[tuple[torch.Tensor, torch.Tensor]],
        keys: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        return image_text_forward(self.image, self.text, images, columns, keys)

    def save_pretrained(self, directory: str) -> None:
        """``model.safetensors`` (both towers, the projections, the scale and bias), then
        ``save_exports``."""
        save_weights(self, directory)
        self.save_exports(directory)

    def save_exports(self, directory: str, whole: Whole = contextlib.nullcontext) -> None:
        """The text tower's encoder and tokenizer in ``tower0/`` through
        ``save_pretrained``, and a pretrained image tower's encoder and processor in
        ``image/`` (merged, with its LoRA adapter in ``image_adapter/``), each inside
        ``whole(tower)`` (``TextPairModel.save_exports``)."""
        tokenizers = [self.tokenizer] if self.tokenizer is not None else []
        described: dict[str, Any] = {"max_length": self.max_length}
        if isinstance(self.image, PretrainedImageModel):
            adapter = IMAGE_DIR + "_adapter"
            with whole(self.image):
                self.image.save_pretrained(
                    os.path.join(directory, IMAGE_DIR), os.path.join(directory, adapter)
                )
            described["image"] = {"path": IMAGE_DIR,
                                  "pooling": getattr(self.image.encoder, "pooling", None),
                                  "projection": self.image.projection.out_features,
                                  "adapter": adapter if is_adapted(self.image.encoder.encoder)
                                  else None}  # fmt: skip
        save_towers(directory, [self.text], tokenizers, described, whole)


def image_text_forward(
    image: Callable[[torch.Tensor], torch.Tensor],
    text: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    images: torch.Tensor,
    columns: Sequence[tuple[torch.Tensor, torch.Tensor]],
    keys: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The images' projections through ``image``, then the caption column's through
    ``text``, each side's dropout keyed by its ``keys`` entry: the forward of
    ``ImageTextModel`` and of ``models.dual_encoder.DualEncoder``."""
    ((input_ids, attention_mask),) = columns
    image_keys, text_keys = keys if keys is not None else (None, None)
    with sample_randomness(image_keys) if keys is not None else contextlib.nullcontext():
        image_rows = image(images)
    with sample_randomness(text_keys) if keys is not None else contextlib.nullcontext():
        text_rows = text(input_ids, attention_mask)
    return torch.cat([image_rows, text_rows])


def save_weights(model: nn.Module, directory: str) -> None:
    """``model``'s state in ``<directory>/model.safetensors``."""
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    state = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
    save_file(state, os.path.join(directory, "model.safetensors"))


class TowerHead(NamedTuple):
    """What a tower stacks on its encoder, for its sentence-transformers export."""

    hidden: int
    pooling: str
    projection: nn.Linear | None
    dense: nn.Sequential | None = None
    normalize: bool = False


def save_towers(
    directory: str, towers, tokenizers, config: dict, whole: Whole = contextlib.nullcontext
) -> list[TowerHead]:
    """Each text tower's encoder and tokenizer in ``tower<i>/`` (``save_pretrained``; an
    adapted encoder merged there, its LoRA adapter in ``adapter<i>/``), one at a time
    inside ``whole(tower)``, and ``config.json`` describing the towers. Returns each
    tower's head for ``export_sentence_transformer``: its width, pooling, copies of its
    projection and dense layers, and whether it normalises."""
    os.makedirs(directory, exist_ok=True)
    described, heads = [], []
    for index, tower in enumerate(towers):
        path = os.path.join(directory, TOWER_DIR.format(index))
        adapter = ADAPTER_DIR.format(index) if is_adapted(tower.encoder) else None
        with whole(tower):
            if adapter:
                save_adapted(tower.encoder, path, os.path.join(directory, adapter))
            else:
                save_without_code(tower.encoder, path, safe_serialization=True)
            # Small: kept past the tower (a sharded model's weights are whole only here).
            projection, dense = copy.deepcopy(tower.projection), copy.deepcopy(tower.dense)
        if index < len(tokenizers):
            save_without_code(tokenizers[index], path)
        heads.append(TowerHead(tower.encoder.config.hidden_size, tower.pooling, projection,
                               dense, tower.normalize))  # fmt: skip
        width = tower.projection.out_features if tower.projection is not None else None
        described.append({"path": TOWER_DIR.format(index), "pooling": tower.pooling,
                          "projection": width, "adapter": adapter})  # fmt: skip
    with open(os.path.join(directory, "config.json"), "w") as file:
        json.dump({"towers": described, **config}, file, indent=2)
    return heads


def export_sentence_transformer(
    heads: Sequence[TowerHead],
    tower_dirs: Sequence[str],
    directory: str,
    max_length: int | None,
    prompts: dict[str, str] | None = None,
) -> bool:
    """The towers saved in ``tower_dirs`` as a ``SentenceTransformer`` saved in
    ``directory``: each encoder, read back from its directory, its pooling, its dense
    layers as ``Dense`` with their activations, its projection as a ``Dense`` without
    one, and ``Normalize`` if it normalises (``heads``, as ``save_towers`` returns
    them); two towers as a ``Router`` of the query (anchor) and document towers, which
    ``encode_query`` and ``encode_document`` take; ``prompts`` by name (``encode(texts,
    prompt_name=...)``, in its ``config_sentence_transformers.json``). Returns False
    (and writes nothing) when sentence-transformers is not installed."""
    try:
        from sentence_transformers import SentenceTransformer
        from sentence_transformers.sentence_transformer.modules import (
            Dense,
            Normalize,
            Pooling,
            Router,
            Transformer,
        )
    except ImportError:
        return False

    def as_dense(linear: nn.Linear, activation: nn.Module) -> nn.Module:
        return Dense(
            linear.in_features, linear.out_features, bias=linear.bias is not None,
            activation_function=activation, init_weight=linear.weight.detach().clone(),
            init_bias=None if linear.bias is None else linear.bias.detach().clone(),
        )  # fmt: skip

    def modules(head: TowerHead, path: str) -> list[nn.Module]:
        stack = [Transformer(path, max_seq_length=max_length), Pooling(head.hidden, head.pooling)]
        layers = list(head.dense or ())  # Linear, activation, Linear, activation...
        pairs = zip(layers[::2], layers[1::2], strict=True)
        stack += [as_dense(linear, activation) for linear, activation in pairs]
        if head.projection is not None:
            stack.append(as_dense(head.projection, nn.Identity()))
        if head.normalize:
            stack.append(Normalize())
        return stack

    stacks = [modules(head, path) for head, path in zip(heads, tower_dirs, strict=True)]
    if len(stacks) == 2:
        stacks = [[Router.for_query_document(query_modules=stacks[0], document_modules=stacks[1])]]
    SentenceTransformer(modules=stacks[0], device="cpu", prompts=prompts or None).save(directory)
    return True
