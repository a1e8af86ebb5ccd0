"""Loading and saving Hugging Face causal LMs and tokenizers from local directories (nothing is downloaded)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from posttrain.config.errors import ConfigError, MissingPathError

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Map a config dtype name ("fp32" | "bf16" | "fp16") to a torch dtype; torch dtypes from DTYPES pass through."""
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise ConfigError(f"dtype={dtype!r} is not supported; use one of {sorted(DTYPES)}")


def check_model_dir(path: str | Path, need: str = "config.json") -> Path:
    """Return ``path`` as a Path after checking it is a local directory holding ``need``.

    Raises FileNotFoundError if the directory does not exist, ValueError if it is not a model directory.
    """
    path = Path(path)
    if not path.is_dir():
        raise MissingPathError(
            f"model path {str(path)!r} does not exist or is not a directory; pass a local Hugging Face model "
            "directory (e.g. one made by posttrain.models.tiny.create_tiny_model_dir); nothing is downloaded"
        )
    if not (path / need).is_file():
        raise ConfigError(
            f"model path {str(path)!r} is not a Hugging Face model directory: it has no {need}; "
            "save one with save_hf(model, tokenizer, path) or model.save_pretrained(path)"
        )
    return path


def read_model_config(path: str | Path, key: str) -> PretrainedConfig:
    """The config.json of the local model directory ``path`` that ``key`` names, read without loading
    weights. A missing directory, a config.json that is not JSON or a model_type this transformers does not
    know is a ConfigError naming ``key`` (transformers raises OSError / ValueError with a traceback)."""
    check_model_dir(path)
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        reason = str(exc).split(". ")[0].strip()
        raise ConfigError(
            f"{key}={str(path)!r}: its config.json cannot be read ({type(exc).__name__}: {reason}); rewrite it "
            "(save_pretrained writes a valid one) or upgrade transformers if the model_type is newer than it"
        ) from exc


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """Load a tokenizer from a local directory, left-padded, with pad token = eos token when it has none.

    Left padding is what batched generation needs (the last prompt token is at the same column in every row).
    """
    path = check_model_dir(path, need="tokenizer_config.json")
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ConfigError(f"tokenizer in {str(path)!r} has neither a pad token nor an eos token; add one")
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def load_causal_lm(
    path: str | Path,
    dtype: str = "fp32",
    device: str | torch.device = "cpu",
    attn_implementation: str = "sdpa",
) -> PreTrainedModel:
    """Load a causal LM from a local directory in ``dtype`` ("fp32" | "bf16" | "fp16") onto ``device``.

    ``sdpa`` attention handles both padded batches and packed rows (position_ids restarting, no mask,
    ``use_cache=False``).
    """
    torch_dtype = resolve_dtype(dtype)
    path = check_model_dir(path)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch_dtype, attn_implementation=attn_implementation, local_files_only=True
    )
    return model.to(device)


def save_hf(model: nn.Module, tokenizer: PreTrainedTokenizerBase | None, path: str | Path) -> Path:
    """Save ``model`` (safetensors) and ``tokenizer`` into ``path`` so :func:`load_causal_lm` reloads them."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)  # transformers >= 5 always writes safetensors
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path
