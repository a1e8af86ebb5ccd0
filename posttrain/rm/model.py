"""The reward model: a Hugging Face ``*ForSequenceClassification`` with one label, its scores, its export.

From a causal LM checkpoint (an SFT model, say) the model is built by ``AutoModelForSequenceClassification``
with ``num_labels=1``: the decoder's weights are the causal LM's, the scalar head ``score`` is new (the LM
head is not used). A sequence-classification checkpoint with one label is loaded as it is.

The score of a sequence is the head's output at its last real token, found from the attention mask, so it is
the same whichever side the padding is on (tested), and whatever token the text ends with.
"""

from __future__ import annotations

import copy
import logging
import warnings
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForSequenceClassification
from transformers.utils import logging as hf_logging

from posttrain.batching.packing import pack_sequences
from posttrain.config.errors import ConfigError
from posttrain.config.load import apply_values
from posttrain.config.schema import PostTrainConfig
from posttrain.models.hf import check_model_dir, resolve_dtype, save_hf
from posttrain.models.lora import hf_model, is_lora_model, lora_config, lora_settings
from posttrain.utils.storage import atomic_dir

log = logging.getLogger("posttrain.rm")


def is_sequence_classifier(config) -> bool:
    return any(a.endswith("ForSequenceClassification") for a in (config.architectures or []))


def load_with_head(auto_class, path: Path, num_labels: int, dtype: str) -> nn.Module:
    """``auto_class.from_pretrained`` with ``num_labels`` outputs: a causal LM's directory gets a new head, without
    transformers' warning that its weights are newly initialized (that is the point here)."""
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        return auto_class.from_pretrained(
            path,
            num_labels=num_labels,
            dtype=resolve_dtype(dtype),
            attn_implementation="sdpa",
            local_files_only=True,
        )
    finally:
        hf_logging.set_verbosity(verbosity)


def load_reward_model(path: str | Path, pad_token_id: int, dtype: str = "fp32", device="cpu") -> nn.Module:
    """A one-label sequence classifier from ``path`` (a causal LM gets a new scalar head)."""
    path = check_model_dir(path)
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    if is_sequence_classifier(config) and config.num_labels != 1:
        raise ConfigError(
            f"model.path={path} is a classifier with num_labels={config.num_labels}; a reward model has one "
            "scalar output: start from a causal LM (it gets a new head) or a num_labels=1 model"
        )
    model = load_with_head(AutoModelForSequenceClassification, path, 1, dtype)
    if not isinstance(getattr(model, "score", None), nn.Linear):
        raise ConfigError(
            f"model.path={path}: {type(model).__name__} has no linear `score` head; posttrain rm supports "
            "decoder models whose classifier is a linear `score` layer (Llama, Qwen, Mistral, GPT-2, ...)"
        )
    model.config.pad_token_id = pad_token_id  # plain transformers finds the last real token through it
    model.config.use_cache = False
    return model.to(device)


def model_config(cfg: PostTrainConfig) -> PostTrainConfig:
    """The config the model directory is resolved with. data.train_files here are pairs, not the user's task:
    builtin:tiny (the arithmetic demo's warm-started model, built from the data.task keys) is allowed, as the
    start of the reward-model demonstration (docs/reward-models.md)."""
    if cfg.model.path != "builtin:tiny":
        return cfg
    return apply_values(cfg, {"data.train_files": [], "data.val_files": [], "sft.train_files": []})


def add_lora(model: nn.Module, cfg: PostTrainConfig) -> nn.Module:
    """LoRA adapters on the decoder (model.lora_rank, lora_alpha, target_modules, lora_dropout) with the
    scalar head trained in full beside them; ``model`` itself when LoRA is off."""
    settings = lora_settings(cfg)
    if settings is None:
        return model
    if settings.adapter_path:
        raise ConfigError(
            "model.lora_adapter_path is not supported by posttrain rm (a policy's adapter has no reward head); "
            "set model.lora_adapter_path= to train a fresh adapter"
        )
    from peft import get_peft_model

    config = lora_config(settings, "SEQ_CLS")  # PEFT then trains the `score` head in full
    with warnings.catch_warnings():  # peft asks `is_gradient_checkpointing`, deprecated in transformers 5
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        return get_peft_model(model, config)


def sequence_scores(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` float32: the head's output at each row's last real token (either padding side).

    input_ids, attention_mask: ``[B, T]``; positions count the real tokens from 0.
    """
    hf = hf_model(model)
    backbone = getattr(hf, hf.base_model_prefix)
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    hidden = backbone(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
    ).last_hidden_state
    columns = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    last = (attention_mask.long() * columns).argmax(-1)
    rows = torch.arange(input_ids.shape[0], device=input_ids.device)
    return hf.score(hidden[rows, last]).squeeze(-1).float()


def packed_sequence_scores(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_row_tokens: int
) -> torch.Tensor:
    """``[B]`` float32: :func:`sequence_scores` computed on the rows' real tokens only (model.use_remove_padding),
    packed into rows of at most ``max_row_tokens`` tokens (raised to the longest sequence), positions restarting
    per sequence. No attention mask and no cache: transformers then builds each row's block-diagonal causal
    mask from the positions (posttrain.forward.packed); the model is loaded with sdpa attention."""
    hf = hf_model(model)
    backbone = getattr(hf, hf.base_model_prefix)
    seqs = [ids[mask.bool()] for ids, mask in zip(input_ids, attention_mask)]
    longest = max(len(s) for s in seqs)
    packed = pack_sequences(seqs, max(max_row_tokens, longest))
    hidden = backbone(
        input_ids=packed.input_ids, position_ids=packed.position_ids, attention_mask=None, use_cache=False
    ).last_hidden_state
    rows = torch.tensor(packed.seq_rows, device=hidden.device)
    last = (
        torch.tensor(packed.seq_starts, device=hidden.device)
        + torch.tensor(packed.seq_lens, device=hidden.device)
        - 1
    )
    return hf.score(hidden[rows, last]).squeeze(-1).float()


def pad_right(seqs: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) ``[B, T]``, right-padded."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, : len(s)] = 1
    return ids, mask


@torch.no_grad()
def score_sequences(
    model: nn.Module,
    seqs: list[list[int]],
    pad_token_id: int,
    batch: int,
    calls: int = 0,
    filler: list[int] | None = None,
) -> torch.Tensor:
    """``[N]`` scores of token sequences, in micro-batches of ``batch`` (eval mode for the call).

    ``calls``: forwards to make at least (a sharded model's ranks must make the same number); the extra ones
    score ``filler`` and are dropped."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    out = []
    for lo in range(0, len(seqs), batch):
        ids, mask = pad_right(seqs[lo : lo + batch], pad_token_id)
        out.append(sequence_scores(model, ids.to(device), mask.to(device)).cpu())
    for _ in range(calls - len(out)):
        ids, mask = pad_right([filler], pad_token_id)
        sequence_scores(model, ids.to(device), mask.to(device))
    model.train(was_training)
    return torch.cat(out) if out else torch.zeros(0)


def export_reward_model(model: nn.Module, tokenizer, path: str | Path, stats: dict[str, float]) -> Path:
    """Save a plain ``AutoModelForSequenceClassification`` directory (LoRA merged), with ``stats``
    (the validation reward mean and std) in its config as ``reward_mean`` and ``reward_std``."""
    path = Path(path)
    hf = hf_model(model)
    for key, value in stats.items():
        setattr(hf.config, key, float(value))
    hf.config.architectures = [type(hf).__name__]
    tokenizer.padding_side = "right"  # plain `tokenizer(texts, padding=True)` then matches the scores here
    if is_lora_model(model):  # a merged copy: the training model keeps its adapters
        hf = copy.deepcopy(model).merge_and_unload()
    with atomic_dir(path, "the reward model") as tmp:  # a kill mid-write leaves no half-written export
        save_hf(hf, tokenizer, tmp)
    return path
