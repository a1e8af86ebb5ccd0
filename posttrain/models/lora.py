"""LoRA on the policy with Hugging Face PEFT: config checks, wrapping, the reference view, weight streams,
checkpoints, export and the memory report.

With ``model.lora_rank > 0`` (or ``model.lora_adapter_path``) the policy becomes a ``peft.PeftModel``: the base
weights are frozen and only the adapters (``lora_A`` / ``lora_B`` of each target linear layer) are trained and
handed to the optimizer (``Trainable.create`` keeps ``requires_grad`` parameters only). Everything else the
trainer does goes through the PeftModel unchanged: ``get_decoder()``, ``get_output_embeddings()``, ``config``,
``activation_checkpointing_enable`` and ``generate``-style calls are forwarded by PEFT to the Hugging Face model.

Two attribute lookups change meaning under the wrapper and must not be used on the policy: ``policy.model`` is
the whole ``*ForCausalLM`` (PEFT's ``LoraModel.model``), not the decoder body, and ``base_model_prefix`` lookups
land on it too. :func:`hf_model` returns the Hugging Face model (adapters injected) for such code.

The reference policy is not a copy: :class:`AdaptersDisabled` runs the same module inside
``PeftModel.disable_adapter()``, which gives exactly the base model's outputs.
"""

from __future__ import annotations

import difflib
import importlib.util
import json
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM

from posttrain.config.errors import ConfigError
from posttrain.config.schema import ModelConfig, PostTrainConfig
from posttrain.utils.console import warn_once

ALL_LINEAR = "all-linear"
# The seeds' guidance: below this rank LoRA may converge more slowly than full fine-tuning.
MIN_RECOMMENDED_RANK = 32
ADAPTER_NAME = "default"
# The usual names of the LM head and input embedding. Their weights are read directly (the chunked log-prob
# head) and are often tied, so an adapter there would be skipped or would break the tie: they are refused.
_EMBEDDING_NAMES = ("lm_head", "embed_tokens")
_ADAPTER_PARTS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector")


# --------------------------------------------------------------------------- config


def lora_enabled(cfg: PostTrainConfig) -> bool:
    """LoRA is on when ``model.lora_rank > 0`` or ``model.lora_adapter_path`` names an adapter."""
    return cfg.model.lora_rank > 0 or bool(cfg.model.lora_adapter_path)


@dataclass(frozen=True)
class LoraSettings:
    """The adapter the run trains: from the config, or from ``model.lora_adapter_path``'s adapter_config.json."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    dropout: float
    adapter_path: str = ""

    @property
    def peft_targets(self) -> str | list[str]:
        return ALL_LINEAR if self.target_modules == (ALL_LINEAR,) else list(self.target_modules)


def read_adapter_config(path: str) -> dict:
    """adapter_config.json of a saved PEFT adapter; ValueError naming ``model.lora_adapter_path`` otherwise."""
    file = Path(path) / "adapter_config.json"
    if not file.is_file():
        raise ConfigError(
            f"model.lora_adapter_path={path!r} is not a PEFT adapter directory (no adapter_config.json); give a "
            "directory written by PeftModel.save_pretrained, e.g. the final_model of a LoRA run with "
            "trainer.export_merged=false, or model.lora_adapter_path= to start a fresh adapter"
        )
    data = json.loads(file.read_text())
    if data.get("peft_type") != "LORA" or data.get("use_dora"):
        kind = "DoRA" if data.get("use_dora") else data.get("peft_type")
        raise ConfigError(
            f"model.lora_adapter_path={path!r} holds a {kind} adapter; posttrain trains plain LoRA adapters "
            "(peft_type LORA, use_dora false). Give a LoRA adapter or model.lora_adapter_path= to start fresh"
        )
    return data


def lora_settings(cfg: PostTrainConfig) -> LoraSettings | None:
    """The run's LoRA settings (None when LoRA is off). Reads the adapter's config when one is given."""
    if not lora_enabled(cfg):
        return None
    m = cfg.model
    if not m.lora_adapter_path:
        return LoraSettings(m.lora_rank, m.lora_alpha, tuple(m.target_modules), m.lora_dropout)
    data = read_adapter_config(m.lora_adapter_path)
    targets = data.get("target_modules") or []
    targets = (targets,) if isinstance(targets, str) else tuple(sorted(targets))
    return LoraSettings(
        int(data["r"]),
        float(data.get("lora_alpha", data["r"])),
        targets,
        float(data.get("lora_dropout", 0.0)),
        m.lora_adapter_path,
    )


def check_lora_config(cfg: PostTrainConfig, model_config=None) -> None:
    """Every LoRA rule, before any weights load. ValueError naming key, value, rule and a valid alternative.

    ``model_config``: the policy's Hugging Face config when known; target module names are then checked against
    the architecture's linear layers (built on the meta device: no memory, no weights).
    """
    m, t = cfg.model, cfg.trainer
    if not lora_enabled(cfg):
        if t.export_merged:
            raise ConfigError(
                "trainer.export_merged=true merges LoRA adapters into the base weights at export, but LoRA is off "
                "(model.lora_rank=0, no model.lora_adapter_path); set model.lora_rank=32 (for example) or "
                "trainer.export_merged=false"
            )
        return
    _require_peft()
    targets = list(m.target_modules)
    if not targets:
        raise ConfigError(
            "model.target_modules=[] gives LoRA no layer to adapt; use model.target_modules=all-linear or a list "
            "such as [q_proj,k_proj,v_proj,o_proj]"
        )
    if ALL_LINEAR in targets and len(targets) > 1:
        raise ConfigError(
            f"model.target_modules={targets} mixes 'all-linear' with module names; use either "
            f"model.target_modules=all-linear or the names alone ({[n for n in targets if n != ALL_LINEAR]})"
        )
    refused = [n for n in targets if n.rsplit(".", 1)[-1] in _EMBEDDING_NAMES]
    if refused:
        raise ConfigError(
            f"model.target_modules={targets} includes {refused}: posttrain reads the LM head and embedding weights "
            "directly (chunked log-prob head, tied embeddings), so they cannot carry adapters. Adapt the decoder's "
            "linear layers: model.target_modules=all-linear"
        )
    if m.lora_alpha <= 0:
        raise ConfigError(
            f"model.lora_alpha={m.lora_alpha:g} must be > 0 (the adapter's output is scaled by lora_alpha / "
            f"lora_rank, so 0 freezes the policy); for example model.lora_alpha={max(m.lora_rank, 16)}"
        )
    if m.lora_dropout >= 1.0:
        raise ConfigError(
            f"model.lora_dropout={m.lora_dropout:g} must be < 1 (1 drops every adapter input); for example "
            "model.lora_dropout=0.0 or 0.05"
        )
    settings = lora_settings(cfg)
    if m.lora_adapter_path:
        _check_adapter_matches(cfg, settings)
    if model_config is not None and settings.target_modules != (ALL_LINEAR,):
        _check_targets_exist(settings.target_modules, model_config, "model.target_modules")
    if settings.rank < MIN_RECOMMENDED_RANK:
        warn_once(
            "model.lora_rank",
            f"model.lora_rank={settings.rank}: ranks below {MIN_RECOMMENDED_RANK} can converge more slowly than "
            f"full fine-tuning (for a 0.5B model rank {MIN_RECOMMENDED_RANK} matches it; larger models want more). "
            "Use the rank that reaches your target accuracy; see docs/lora.md",
        )


def _check_adapter_matches(cfg: PostTrainConfig, s: LoraSettings) -> None:
    """The adapter defines rank, alpha, targets and dropout; a config value that contradicts it is a mistake."""
    m = cfg.model
    if m.lora_rank not in (0, s.rank):
        raise ConfigError(
            f"model.lora_rank={m.lora_rank} differs from the rank r={s.rank} of the adapter at "
            f"model.lora_adapter_path={m.lora_adapter_path!r}; set model.lora_rank={s.rank} (or 0: take the "
            "adapter's rank)"
        )
    default = ModelConfig()
    ours = {  # key: (config value, schema default, adapter value)
        "model.lora_alpha": (m.lora_alpha, default.lora_alpha, s.alpha),
        "model.lora_dropout": (m.lora_dropout, default.lora_dropout, s.dropout),
        "model.target_modules": (
            tuple(sorted(m.target_modules)),
            tuple(default.target_modules),
            s.target_modules,
        ),
    }
    # Only a value the user set (not the schema default) can contradict the adapter.
    differing = [f"{k}={v!r} (adapter: {a!r})" for k, (v, d, a) in ours.items() if v != d and v != a]
    if differing:
        raise ConfigError(
            f"model.lora_adapter_path={m.lora_adapter_path!r} defines the adapter's settings, but "
            f"{', '.join(differing)}; drop these keys (the adapter's values apply) or set them to the adapter's"
        )


def linear_module_names(model_config) -> list[str] | None:
    """Dotted names of the linear layers of the architecture (built on the meta device); None if it cannot be."""
    try:
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = AutoModelForCausalLM.from_config(model_config)
    except Exception:  # an architecture transformers cannot build here: PEFT reports unknown names at load
        return None
    head = model.get_output_embeddings()
    return [n for n, mod in model.named_modules() if isinstance(mod, nn.Linear) and mod is not head]


def _check_targets_exist(targets: tuple[str, ...], model_config, key: str) -> None:
    names = linear_module_names(model_config)
    if names is None:
        return
    leaves = sorted({n.rsplit(".", 1)[-1] for n in names})
    unknown = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
    if unknown:
        close = [c for u in unknown for c in difflib.get_close_matches(u, leaves, n=1)]
        hint = f" (did you mean {close}?)" if close else ""
        raise ConfigError(
            f"{key}={list(targets)}: {unknown} match no linear layer of the decoder of model_type="
            f"{getattr(model_config, 'model_type', '?')!r}{hint}; its linear layers are {leaves} (the LM head "
            f"cannot carry an adapter). Use names from that list or {key}=all-linear"
        )


def _require_peft() -> None:
    if importlib.util.find_spec("peft") is None:
        raise ConfigError(
            "model.lora_rank > 0 (or model.lora_adapter_path) needs Hugging Face PEFT: pip install 'posttrain[lora]' "
            "(or pip install peft), or set model.lora_rank=0"
        )


# --------------------------------------------------------------------------- wrapping


def apply_lora(model: nn.Module, cfg: PostTrainConfig) -> nn.Module:
    """The policy with LoRA adapters (a ``peft.PeftModel``), or ``model`` unchanged when LoRA is off.

    A fresh adapter starts with ``lora_B = 0``, so the wrapped policy computes exactly what ``model`` did. With
    ``model.lora_adapter_path`` the saved adapter is loaded trainable. The base weights are frozen in place.
    """
    settings = lora_settings(cfg)
    if settings is None:
        return model
    from peft import PeftModel, get_peft_model

    with warnings.catch_warnings():
        # peft asks the model `is_gradient_checkpointing`, which transformers 5 deprecates: not ours to fix.
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        if settings.adapter_path:
            policy = PeftModel.from_pretrained(model, settings.adapter_path, is_trainable=True)
        else:
            policy = get_peft_model(model, lora_config(settings, "CAUSAL_LM"))
    if hasattr(policy.get_output_embeddings(), "get_base_layer"):  # e.g. an adapter's targets named the head
        raise ConfigError(
            "the LoRA targets include the LM head, whose weight posttrain reads directly (chunked log-prob head, "
            "tied embeddings); adapt the decoder's linear layers only: model.target_modules=all-linear"
        )
    return policy


def lora_config(settings: LoraSettings, task_type: str):
    """The ``peft.LoraConfig`` of these settings for a model of ``task_type`` ("CAUSAL_LM" for a policy;
    "SEQ_CLS" for a reward model, whose score head PEFT then trains in full)."""
    from peft import LoraConfig

    return LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        target_modules=settings.peft_targets,
        lora_dropout=settings.dropout,
        bias="none",
        task_type=task_type,
    )


def is_lora_model(model: nn.Module) -> bool:
    """True for a PEFT-wrapped policy (what :func:`apply_lora` returns with LoRA on)."""
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def hf_model(model: nn.Module) -> nn.Module:
    """The Hugging Face ``*ForCausalLM`` under a PeftModel (adapters injected), or ``model`` itself.

    Use it where code needs Hugging Face attribute paths (``.model.layers``, ``base_model_prefix``), which
    PEFT's wrapper resolves differently (``peft_model.model`` is the whole causal LM).
    """
    return model.get_base_model() if is_lora_model(model) else model


def adapter_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """(full module name, parameter) of every LoRA adapter weight of a PeftModel."""
    for name, param in model.named_parameters():
        if any(part in _ADAPTER_PARTS for part in name.split(".")):
            yield name, param


class AdaptersDisabled(nn.Module):
    """The reference policy of a LoRA run: the actor's own module with its adapters disabled.

    It exposes what the log-prob code reads from a policy (``config``, ``get_decoder()``,
    ``get_output_embeddings()``) and runs every call inside ``PeftModel.disable_adapter()`` in eval mode, so
    it computes the base model's outputs with no second copy of the base weights. The actor is deliberately not
    a registered submodule: ``.eval()``, ``.to()`` or ``requires_grad_`` on the reference must not reach it.

    PEFT's ``disable_adapter()`` switches the adapters' ``requires_grad`` off and back on around the call.
    """

    def __init__(self, policy: nn.Module):
        super().__init__()
        if not is_lora_model(policy):
            raise TypeError(f"AdaptersDisabled needs a peft.PeftModel, got {type(policy).__name__}")
        self._policy = (policy,)  # a tuple hides it from nn.Module's registration

    @property
    def policy(self) -> nn.Module:
        return self._policy[0]

    @property
    def config(self):
        return self.policy.config

    def get_decoder(self) -> nn.Module:
        return _RunWithAdaptersDisabled(self.policy, self.policy.get_decoder())

    def get_output_embeddings(self) -> nn.Module:
        head = self.policy.get_output_embeddings()
        return head.get_base_layer() if hasattr(head, "get_base_layer") else head

    def forward(self, *args, **kwargs):
        return _RunWithAdaptersDisabled(self.policy, self.policy)(*args, **kwargs)


class _RunWithAdaptersDisabled(nn.Module):
    """Calls ``inner`` (the policy or its decoder) with the PeftModel's adapters off, in eval mode."""

    def __init__(self, policy: nn.Module, inner: nn.Module):
        super().__init__()
        self._refs = (policy, inner)

    def forward(self, *args, **kwargs):
        policy, inner = self._refs
        was_training = policy.training
        policy.eval()
        try:
            with policy.disable_adapter():
                return inner(*args, **kwargs)
        finally:
            policy.train(was_training)


def reference_policy(policy: nn.Module) -> AdaptersDisabled:
    """The reference policy for a LoRA actor: the same module with adapters disabled (no weight copy)."""
    return AdaptersDisabled(policy)


# --------------------------------------------------------------------------- weight streams (rollout sync)


def adapter_state(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(PEFT name, tensor) of the adapter weights, named as in a saved ``adapter_model.safetensors``
    (``base_model.model.<module>.lora_A.weight``): what an engine serving LoRA adapters loads. Detached views of
    the live weights (no copy); an engine in another process copies them as they arrive."""
    from peft.utils import get_peft_model_state_dict

    for name, tensor in get_peft_model_state_dict(model, adapter_name=ADAPTER_NAME).items():
        yield name, _gathered(tensor.detach())


def merged_state(model: nn.Module, only_adapted: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor) of the policy with adapters merged, named like the plain model's state_dict.

    An adapted weight is computed as ``W + get_delta_weight()`` (PEFT's ``scale * B @ A``, in fp32, cast back to
    W's dtype) into a new tensor: the training model is not modified. Other tensors are the live ones (no copy).
    One tensor at a time, so an engine can load layer by layer; under FSDP2 each tensor is gathered as it is
    yielded (every rank must walk the stream). ``only_adapted``: only the adapted weights (the rest never change
    in a LoRA run, so an engine that already holds the base needs only these). Tied weights appear under both
    names, as in the plain model's state_dict.
    """
    from peft.tuners.lora import LoraLayer

    base = hf_model(model)
    adapted = {name: mod for name, mod in base.named_modules() if isinstance(mod, LoraLayer)}
    with torch.no_grad():
        for name, tensor in base.state_dict().items():
            if any(part in _ADAPTER_PARTS for part in name.split(".")):
                continue
            layer, sep, leaf = name.partition(".base_layer.")
            if not sep:
                if not only_adapted:
                    yield name, _gathered(tensor)
                continue
            plain = f"{layer}.{leaf}"
            if leaf == "weight" and layer in adapted and ADAPTER_NAME in adapted[layer].lora_A:
                delta = adapted[layer].get_delta_weight(ADAPTER_NAME)
                yield plain, _gathered((tensor.float() + delta.float()).to(tensor.dtype))
            elif not only_adapted:
                yield plain, _gathered(tensor)


def _gathered(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor (an FSDP2-sharded parameter) becomes the full tensor, one tensor at a time (a collective: every
    rank must walk the same stream); a plain tensor is returned as it is."""
    full_tensor = getattr(tensor, "full_tensor", None)
    return full_tensor() if callable(full_tensor) else tensor


def policy_weights(model: nn.Module, mode: str = "merged") -> Iterator[tuple[str, torch.Tensor]]:
    """What ``RolloutEngine.sync_weights`` gets for this policy: ``mode='merged'`` (Hugging Face names, adapters
    merged; any engine holding a plain copy), ``'adapter'`` (PEFT adapter tensors only; an engine serving LoRA
    itself), or the plain state_dict for a policy without LoRA."""
    if not is_lora_model(model):
        for name, tensor in model.state_dict().items():
            yield name, _gathered(tensor)
    elif mode == "adapter":
        yield from adapter_state(model)
    elif mode == "merged":
        yield from merged_state(model)
    else:
        raise ConfigError(f"weight sync mode {mode!r} must be 'merged' or 'adapter'")


# --------------------------------------------------------------------------- checkpoints and export


# --------------------------------------------------------------------------- memory report


@dataclass(frozen=True)
class LoraMemory:
    """Bytes of the policy's model states with LoRA, and what full fine-tuning would hold (AdamW: 2 states)."""

    total_params: int  # base + adapters
    trainable_params: int  # adapters
    base_bytes: int  # frozen base weights (tied weights once)
    trainable_bytes: int  # adapter weights (PEFT keeps them fp32 when the base is bf16/fp16)
    optimizer_bytes: int  # AdamW exp_avg + exp_avg_sq of the adapters
    full_optimizer_bytes: int  # the same for every base weight (full fine-tuning)
    reference_shared_bytes: int  # base weights a reference copy would have duplicated (0: no KL term)


def lora_memory(model: nn.Module, uses_reference: bool) -> LoraMemory:
    """Measure the policy's parameters (tied weights counted once)."""
    seen: set[int] = set()
    base = trainable = base_bytes = trainable_bytes = 0
    for p in model.parameters():  # parameters() yields a tied tensor once
        if id(p) in seen:
            continue
        seen.add(id(p))
        if p.requires_grad:
            trainable += p.numel()
            trainable_bytes += p.numel() * p.element_size()
        else:
            base += p.numel()
            base_bytes += p.numel() * p.element_size()
    return LoraMemory(
        total_params=base + trainable,
        trainable_params=trainable,
        base_bytes=base_bytes,
        trainable_bytes=trainable_bytes,
        optimizer_bytes=2 * trainable_bytes,
        full_optimizer_bytes=2 * base_bytes,
        reference_shared_bytes=base_bytes if uses_reference else 0,
    )


def lora_memory_summary(model: nn.Module, uses_reference: bool) -> str:
    """One line for the start of a run: trainable share, optimizer states vs full fine-tuning, reference saving."""
    m = lora_memory(model, uses_reference)
    mib = 2**20
    ref = (
        f"; reference policy = adapters disabled, {m.reference_shared_bytes / mib:.1f} MiB of base weights not copied"
        if uses_reference
        else ""
    )
    return (
        f"LoRA: {m.trainable_params:,} trainable of {m.total_params:,} parameters "
        f"({100 * m.trainable_params / max(m.total_params, 1):.2f}%, {m.trainable_bytes / mib:.1f} MiB); "
        f"optimizer states {m.optimizer_bytes / mib:.1f} MiB (full fine-tuning: {m.full_optimizer_bytes / mib:.1f} MiB)"
        f"{ref}"
    )
