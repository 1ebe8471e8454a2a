"""A sentence-transformers folder as a text tower's starting point: what its
``modules.json`` stacks after the ``transformers`` model (its pooling, ``Dense`` layers
and ``Normalize``), its ``max_seq_length`` and its prompts, read from JSON and
safetensors only (nothing in it runs).

    folder = read_sentence_folder("path/to/bge-small")   # None: a plain transformers folder
    tower = TextTower(encoder, folder.pooling, dense=folder.dense_layers(torch.float32),
                      normalize=folder.normalize)
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
from torch import nn

from contrastive_accelerate.untrusted import read_json
from models.text import POOLINGS

#: ``Dense`` activations a folder may name (by torch's class path), without importing
#: what the file names: anything else is refused.
ACTIVATIONS: dict[str, type[nn.Module]] = {
    "torch.nn.modules.activation.Tanh": nn.Tanh,
    "torch.nn.modules.linear.Identity": nn.Identity,
    "torch.nn.modules.activation.ReLU": nn.ReLU,
    "torch.nn.modules.activation.GELU": nn.GELU,
}
#: sentence-transformers 2-5's pooling flags, by the mode each names.
POOLING_FLAGS = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean",
                 "pooling_mode_max_tokens": "max", "pooling_mode_lasttoken": "lasttoken",
                 "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                 "pooling_mode_weightedmean_tokens": "weightedmean"}  # fmt: skip


class SentenceFolderError(ValueError):
    """A sentence-transformers folder that cannot be taken as it is, in one line."""


@dataclass
class DenseLayer:
    """One ``Dense`` module, ``activation(W x + b)``: its weights file, read when the
    layer is built (``weights``), so that reading a folder's stack (every time the
    options resolve) reads JSON only."""

    weights_file: str
    activation: str

    def weights(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``W`` and ``b`` (None without a bias), from safetensors."""
        from safetensors.torch import load_file

        weights = load_file(self.weights_file)
        if "linear.weight" not in weights:
            raise SentenceFolderError(f"{self.weights_file}: no linear.weight")
        return weights["linear.weight"], weights.get("linear.bias")


@dataclass
class SentenceFolder:
    """What a sentence-transformers folder stacks on its ``transformers`` model."""

    #: The subfolder holding the transformers model and tokenizer ("" : the folder).
    transformer: str
    pooling: str
    dense: list[DenseLayer] = field(default_factory=list)
    normalize: bool = False
    max_seq_length: int | None = None
    prompts: dict[str, str] = field(default_factory=dict)

    def dense_layers(self, dtype: torch.dtype) -> nn.Sequential | None:
        """The ``Dense`` modules as ``Linear`` and activation layers, in ``dtype``."""
        if not self.dense:
            return None
        layers: list[nn.Module] = []
        for dense in self.dense:
            weight, bias = dense.weights()
            linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
            with torch.no_grad():
                linear.weight.copy_(weight)
                if bias is not None:
                    linear.bias.copy_(bias)
            layers += [linear, ACTIVATIONS[dense.activation]()]
        return nn.Sequential(*layers).to(dtype)


def load_sentence_tower(path: str, dtype: torch.dtype, flag: str):
    """``path`` as a frozen embedder, as sentence-transformers loads it: a
    sentence-transformers folder taken as it is (its pooling, Dense layers and
    Normalize) or a plain ``transformers`` model under mean pooling, in eval mode and
    without gradients; with its tokenizer and its folder (None for a plain model).
    Errors name ``flag``."""
    from models.text import TextTower, load_text_encoder

    folder = read_sentence_folder(path)
    model_path = os.path.join(path, folder.transformer) if folder else path
    encoder, tokenizer = load_text_encoder(model_path, dtype, flag=flag)
    tower = TextTower(
        encoder,
        folder.pooling if folder else "mean",
        dense=folder.dense_layers(dtype) if folder else None,
        normalize=folder.normalize if folder else False,
    )
    return tower.to(dtype).eval().requires_grad_(False), tokenizer, folder


def read_sentence_folder(path: str) -> SentenceFolder | None:
    """``path``'s sentence-transformers stack, or None when it has no ``modules.json``
    (a plain ``transformers`` folder, or a hub name). A module it cannot take (another
    kind, a pooling mode or an activation not there yet) is a ``SentenceFolderError``."""
    modules_file = os.path.join(path, "modules.json")
    if not os.path.isfile(modules_file):
        return None
    modules = read_json(modules_file)
    if not isinstance(modules, list) or not modules:
        raise SentenceFolderError(f"{modules_file}: a list of modules expected")
    kinds = [str(module.get("type", "")).rsplit(".", 1)[-1] for module in modules]
    if kinds[0] != "Transformer" or (kinds[1:2] != ["Pooling"]):
        raise SentenceFolderError(
            f"--text-model {path!r}: its modules are {', '.join(kinds)}; a Transformer then "
            "a Pooling is taken"
        )
    folder = SentenceFolder(modules[0].get("path", ""), _pooling(path, modules[1]["path"]))
    for module, kind in zip(modules[2:], kinds[2:], strict=True):
        if kind == "Dense" and not folder.normalize:
            folder.dense.append(_dense(os.path.join(path, module["path"])))
        elif kind == "Normalize" and module is modules[-1]:
            folder.normalize = True
        else:
            raise SentenceFolderError(
                f"--text-model {path!r}: its module {kind} is not taken here yet (a "
                "Transformer, a Pooling, Dense layers and a last Normalize are)"
            )
    folder.max_seq_length = _max_seq_length(os.path.join(path, folder.transformer))
    described = os.path.join(path, "config_sentence_transformers.json")
    if os.path.isfile(described):
        prompts = read_json(described).get("prompts") or {}
        folder.prompts = {str(k): str(v) for k, v in prompts.items() if v}
    return folder


def _max_seq_length(directory: str) -> int | None:
    """sentence-transformers 2-5's ``max_seq_length`` (``sentence_bert_config.json``), or
    6's: its tokenizer's ``model_max_length``."""
    for name, key in (("sentence_bert_config.json", "max_seq_length"),
                      ("tokenizer_config.json", "model_max_length")):  # fmt: skip
        file = os.path.join(directory, name)
        length = read_json(file).get(key) if os.path.isfile(file) else None
        if isinstance(length, int) and 0 < length < 1_000_000:  # not transformers' "no limit"
            return length
    return None


def _pooling(path: str, subfolder: str) -> str:
    """The folder's pooling mode: sentence-transformers 6's ``pooling_mode``, or the one
    ``pooling_mode_*`` flag of earlier versions that is set."""
    config = read_json(os.path.join(path, subfolder, "config.json"))
    modes = config.get("pooling_mode") or [
        mode for flag, mode in POOLING_FLAGS.items() if config.get(flag)
    ]  # fmt: skip
    modes = modes if isinstance(modes, list) else [modes]  # 6 concatenates a list's
    if config.get("include_prompt", True) is not True:
        raise SentenceFolderError(
            f"--text-model {path!r}: pooling without the prompt's tokens (include_prompt "
            "false) is not taken here yet"
        )
    if len(modes) != 1 or modes[0] not in POOLINGS:
        raise SentenceFolderError(
            f"--text-model {path!r}: pooling {' + '.join(map(str, modes)) or 'none'} is not "
            f"taken here yet ({', '.join(POOLINGS)} are)"
        )
    return modes[0]


def _dense(directory: str) -> DenseLayer:
    config = read_json(os.path.join(directory, "config.json"))
    activation = config.get("activation_function", "torch.nn.modules.activation.Tanh")
    if activation not in ACTIVATIONS:
        raise SentenceFolderError(
            f"{directory}: activation {activation!r} is not taken here yet "
            f"({', '.join(name.rsplit('.', 1)[-1] for name in ACTIVATIONS)} are)"
        )
    weights_file = os.path.join(directory, "model.safetensors")
    if not os.path.isfile(weights_file):
        raise SentenceFolderError(f"{directory}: no model.safetensors (a pickle is not read)")
    return DenseLayer(weights_file, activation)
