"""FSDP2 applied from outside the model: one ``fully_shard`` per decoder layer, then one for the root.

The model code knows nothing of this; every knob of a role's ``fsdp_config`` acts here:

- ``fsdp_size``: -1 shards over all ranks (a 1-D mesh); k shards within groups of k ranks and replicates
  across the world / k groups (HSDP on a 2-D ``("replicate", "shard")`` DeviceMesh). Gradients are
  averaged over all ranks either way.
- ``param_offload``: FSDP2's ``CPUOffloadPolicy`` (sharded parameters and gradients live in CPU memory; the
  optimizer step runs on CPU). CUDA only.
- ``reshard_after_forward``: free gathered layer parameters after forward (ZeRO-3) or keep them for
  backward.
- ``forward_prefetch``: explicit prefetching: layer i's forward starts layer i+1's all-gather, layer i's
  backward starts layer i-1's.
- mixed precision on CUDA: parameters kept in fp32 (the master copy the optimizer updates), computed in the
  model's dtype, gradients reduced in fp32.

``optimizer_offload`` is not an FSDP2 feature: :func:`offload_optimizer_state` moves Adam's state to CPU
between steps.
"""

from __future__ import annotations

import logging
import warnings

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

from posttrain.config.errors import ConfigError
from posttrain.config.plan import fsdp_group_size
from posttrain.config.schema import ShardingConfig
from posttrain.parallel.runtime import DistContext

log = logging.getLogger("posttrain")


def sharding_mesh(ctx: DistContext, fsdp_size: int) -> DeviceMesh:
    """The mesh a model is sharded on: 1-D over all ranks, or ("replicate", "shard") for HSDP."""
    group = fsdp_group_size(fsdp_size, ctx.world_size, "fsdp_config.fsdp_size")
    if group == ctx.world_size:
        return init_device_mesh(ctx.device.type, (ctx.world_size,), mesh_dim_names=("shard",))
    return init_device_mesh(
        ctx.device.type, (ctx.world_size // group, group), mesh_dim_names=("replicate", "shard")
    )


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks of a Hugging Face model (also inside a critic or a PEFT wrapper).

    Found by the class names the model declares unsplittable (``_no_split_modules``, what HF and accelerate
    wrap for FSDP); when none is declared, the children of the largest ``nn.ModuleList``.
    """
    names: set[str] = set()
    for m in model.modules():
        names.update(getattr(m, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if layers:
        return layers
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if not lists:
        raise ConfigError(f"{type(model).__name__} has no decoder layers to shard (no ModuleList found)")
    biggest = max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))
    return list(biggest)


def shard_model(
    module: nn.Module,
    ctx: DistContext,
    cfg: ShardingConfig,
    compute_dtype: torch.dtype,
    called_directly: tuple[nn.Module, ...] = (),
) -> nn.Module:
    """Apply FSDP2 in place (layers, then root) and return the module; parameters must be on ``ctx.device``.

    ``compute_dtype``: the dtype forward/backward run in. On CUDA the parameters stay fp32 (master weights)
    and FSDP2 casts each gathered layer to ``compute_dtype``; on CPU everything runs in the parameters' dtype.
    ``called_directly``: sub-modules the caller's forward code calls on their own that are not found below
    (e.g. a head nested inside a PEFT wrapper); each becomes its own unit.
    """
    # FSDP2 warns when a wrapped module returns a view (an in-place op on it would skip a hook); heads and
    # the critic return views ([..., 0], reshapes) that posttrain only ever reads.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    mesh = sharding_mesh(ctx, cfg.fsdp_size)
    kwargs: dict = {"mesh": mesh}
    if ctx.device.type == "cuda" and compute_dtype != torch.float32:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    if cfg.param_offload:
        if ctx.device.type == "cuda":
            kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=True)
        else:
            log.warning(
                "fsdp_config.param_offload has no effect on CPU (parameters are already in CPU memory)"
            )
    layers = decoder_layers(module)
    for layer in layers:
        fully_shard(layer, reshard_after_forward=cfg.reshard_after_forward, **kwargs)
    for unit in _directly_called_units(module, layers, called_directly):
        # Called on their own by posttrain's forward code (which never calls the top module's forward for
        # the policy: it runs the decoder body, then the head on response positions only), so each needs
        # its own FSDP unit, i.e. its own gather-before-use hooks.
        fully_shard(unit, reshard_after_forward=False, **kwargs)
    # The root holds whatever is left and drives the end-of-backward bookkeeping.
    fully_shard(module, reshard_after_forward=False, **kwargs)
    if cfg.forward_prefetch:
        for i, layer in enumerate(layers):
            if i + 1 < len(layers):
                layer.set_modules_to_forward_prefetch([layers[i + 1]])
            if i > 0:
                layer.set_modules_to_backward_prefetch([layers[i - 1]])
    return module


def _directly_called_units(
    model: nn.Module, layers: list[nn.Module], called_directly: tuple[nn.Module, ...] = ()
) -> list[nn.Module | list[nn.Module]]:
    """Sub-modules the forward code calls directly, innermost first: the caller's ``called_directly``, the
    input embedding grouped with a tied output head (one shared weight must live in one unit), an untied head,
    the decoder body, and any other child with parameters of its own (e.g. a critic's value head)."""
    units: list = list(called_directly)
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    tied = embed is not None and head is not None and head.weight is embed.weight
    if tied:
        units.append([embed, head])
    else:
        units += [m for m in (embed, head) if m is not None]
    body = model.get_decoder() if hasattr(model, "get_decoder") else None
    if body is not None and body is not model:
        units.append(body)
    claimed = {
        id(p)
        for unit in [*layers, *units]
        for m in (unit if isinstance(unit, list) else [unit])
        for p in m.parameters()
    }
    for child in model.children():
        own = [p for p in child.parameters() if id(p) not in claimed]
        if own and not any(child is u for u in units):
            units.append(child)
            claimed.update(id(p) for p in child.parameters())
    return units


def is_sharded(module: nn.Module) -> bool:
    return isinstance(module, FSDPModule)


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer as a full (unsharded) tensor, on every rank; a plain state_dict when unsharded.

    A collective for a sharded module: all ranks must call it.
    """
    if not is_sharded(module):
        return module.state_dict()

    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))


def _move_state(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    for state in optimizer.state.values():
        for key, value in state.items():
            # Adam's "step" counter stays where the optimizer put it (a CPU scalar unless capturable).
            if key != "step" and isinstance(value, torch.Tensor) and value.device != device:
                state[key] = value.to(device, non_blocking=True)


def offload_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device, enabled: bool) -> None:
    """``optimizer_offload``: the optimizer's state lives in CPU memory except during ``optimizer.step()``.

    Adam keeps two fp32 moments per parameter (2x the parameter bytes); between steps, while rollout and the
    forward passes need GPU memory, they wait in CPU memory. Implemented with the optimizer's step hooks, so
    the training loop does not change; copies are exact, so training is unchanged too.
    """
    if not enabled:
        return
    if device.type != "cuda":
        log.warning("fsdp_config.optimizer_offload has no effect on CPU (the state is already in CPU memory)")
        return

    def load(opt, args, kwargs):
        _move_state(opt, device)

    def offload(opt, args, kwargs):
        _move_state(opt, torch.device("cpu"))
        torch.cuda.synchronize(device)

    optimizer.register_step_pre_hook(load)
    optimizer.register_step_post_hook(offload)
