"""`posttrain explain rm ...`: the plan of a reward-model run, from its config and its pair files, before any
weights load.

What it shows: the pairs (read and checked as `posttrain rm` reads them, tokenized with the model's tokenizer
to count those longer than rm.max_length), how a step's pairs become micro-batches and gradient-accumulation
steps, how many optimizer steps the run takes, and a memory estimate of one training micro-batch (weights,
gradients, AdamW moments, activations of the longest pairs) from the model's config.json.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from posttrain.batching.packing import plan_rows
from posttrain.config.errors import ConfigError
from posttrain.config.schema import PostTrainConfig
from posttrain.models.hf import load_tokenizer
from posttrain.models.lora import lora_settings
from posttrain.models.model_path import BUILTIN_NAMES, builtin_base_dir, resolve_model_path
from posttrain.planning.memory_bytes import (
    DTYPE_BYTES,
    FULL,
    Training,
    update_activation_bytes,
    update_step_bytes,
)
from posttrain.planning.shape import ModelShape, shape_for_model_path
from posttrain.rm.command import check_ranks, token_budget
from posttrain.rm.data import TokenizedPair, load_pairs, tokenize_pairs
from posttrain.rm.loop import rm_schedule


@dataclass(frozen=True)
class PairCounts:
    """Pairs of one split: read, kept (both sides within rm.max_length), and the longest kept text."""

    read: int
    kept: int
    longest_tokens: int


@dataclass(frozen=True)
class RMBatchPlan:
    """How `posttrain rm` walks through the pairs (posttrain.rm.loop.rm_schedule, posttrain.rm.loss)."""

    pairs_per_step: int
    ranks: int  # data-parallel ranks (torchrun's processes); each trains pairs_per_rank of every step
    pairs_per_rank: int
    pairs_per_micro: int  # 0: by token budget (rm.use_dynamic_bsz)
    token_budget: int  # 0: by pair count
    accumulation_steps: int
    steps_per_epoch: int
    pairs_left_out_per_epoch: int
    total_steps: int


@dataclass(frozen=True)
class RMMemory:
    """Bytes on the device at the backward's peak of one micro-batch (model.dtype throughout)."""

    parameters: int
    trainable_parameters: int
    weights: int
    gradients: int
    optimizer: int
    activations: int
    micro_batch_tokens: int

    @property
    def peak(self) -> int:
        return self.weights + self.optimizer + update_step_bytes(self.activations, self.gradients)


def run_tokenizer(cfg: PostTrainConfig):
    """The run's tokenizer without building a model: the built-in models share builtin:base's tokenizer (so
    builtin:tiny's warm start is not trained here)."""
    if cfg.model.path in BUILTIN_NAMES:
        return load_tokenizer(builtin_base_dir(cfg))
    return load_tokenizer(resolve_model_path(cfg, quiet=True, warm_start=None))  # built-in names: above


def count_pairs(
    cfg: PostTrainConfig, files: list[str], tokenizer, training: bool = False
) -> tuple[PairCounts, list[TokenizedPair]]:
    """The counts of ``files``' pairs and the pairs kept; for the ``training`` pairs, also `posttrain rm`'s
    token-budget check."""
    pairs = load_pairs(cfg, files)
    kept, _ = tokenize_pairs(pairs, tokenizer, cfg.rm.max_length)
    if training and kept:
        token_budget(cfg, kept)
    longest = max((max(len(p.chosen_ids), len(p.rejected_ids)) for p in kept), default=0)
    return PairCounts(len(pairs), len(kept), longest), kept


def packed_micro_batch_tokens(cfg: PostTrainConfig, pairs: list[TokenizedPair], pairs_per_micro: int) -> int:
    """Tokens the packed forward (model.use_remove_padding) computes for a micro-batch of the
    ``pairs_per_micro`` longest pairs: their texts packed into rows of model.remove_padding_max_row_tokens
    (raised to the longest text), each row padded to the longest row, as posttrain.batching.packing lays
    them out."""
    biggest = sorted(pairs, key=lambda p: len(p.chosen_ids) + len(p.rejected_ids), reverse=True)
    lens = [len(ids) for p in biggest[:pairs_per_micro] for ids in (p.chosen_ids, p.rejected_ids)]
    rows = plan_rows(lens, max(cfg.model.remove_padding_max_row_tokens, max(lens)))
    return len(rows) * max(sum(lens[i] for i in row) for row in rows)


def batch_plan(cfg: PostTrainConfig, train_pairs: int, world_size: int = 1) -> RMBatchPlan:
    """The steps a run of ``train_pairs`` usable pairs takes on ``world_size`` data-parallel ranks; refuses
    what `posttrain rm` refuses."""
    r = cfg.rm
    if train_pairs < r.batch_size:
        raise ConfigError(
            f"rm.batch_size={r.batch_size} exceeds the {train_pairs} usable training pairs (after dropping "
            f"those longer than rm.max_length={r.max_length}); lower rm.batch_size"
        )
    check_ranks(cfg, world_size)
    per_rank = r.batch_size // world_size
    micro = 0 if r.use_dynamic_bsz else min(r.micro_batch_size_per_gpu, per_rank)
    schedule = rm_schedule(cfg, train_pairs)
    return RMBatchPlan(
        pairs_per_step=r.batch_size,
        ranks=world_size,
        pairs_per_rank=per_rank,
        pairs_per_micro=micro,
        token_budget=r.max_token_len_per_gpu if r.use_dynamic_bsz else 0,
        accumulation_steps=-(-per_rank // micro) if micro else 0,  # 0: varies with the lengths
        steps_per_epoch=schedule.steps_per_epoch,
        pairs_left_out_per_epoch=schedule.left_out_per_epoch,
        total_steps=schedule.total_steps,
    )


def _training(cfg: PostTrainConfig) -> Training:
    settings = lora_settings(cfg)
    return Training(settings.rank, settings.target_modules) if settings is not None else FULL


def memory_estimate(
    cfg: PostTrainConfig, shape: ModelShape, plan: RMBatchPlan, longest: int, packed_tokens: int | None = None
) -> RMMemory:
    """One micro-batch of ``plan.pairs_per_micro`` pairs (twice as many sequences) padded to ``longest``
    tokens, or ``packed_tokens`` (model.use_remove_padding: :func:`packed_micro_batch_tokens`), or of the
    token budget (rm.use_dynamic_bsz; padding not counted). The reward model has no LM head: a
    causal LM's untied output matrix is replaced by a hidden_size x 1 ``score`` layer, trained in full also with
    LoRA. On several ranks FSDP2 shards weights, gradients and moments over them (``plan.ranks``); the layer
    gathered for its forward/backward is not counted."""
    dtype = DTYPE_BYTES[cfg.model.dtype]
    head = 0 if shape.tie_word_embeddings else shape.vocab_size * shape.hidden_size
    params = shape.num_params() - head + shape.hidden_size
    training = _training(cfg)
    trainable = params
    if training.lora_rank:
        trainable = shape.lora_params(training.lora_rank, training.target_modules) + shape.hidden_size
    tokens = plan.token_budget or packed_tokens or 2 * plan.pairs_per_micro * longest
    activations = update_activation_bytes(
        shape, tokens, dtype, checkpointing=False, offload=False, training=training
    )
    ranks = plan.ranks
    return RMMemory(
        parameters=params,
        trainable_parameters=trainable,
        weights=-(-params * dtype // ranks),
        gradients=-(-trainable * dtype // ranks),
        optimizer=-(-2 * trainable * dtype // ranks),
        activations=activations,
        micro_batch_tokens=tokens,
    )


def rm_plan(cfg: PostTrainConfig, model_config: str | None = None, world_size: int = 1) -> dict:
    """Everything `posttrain explain rm` prints, as a dict (``--json``), for ``world_size`` data-parallel
    ranks. Reads and checks the pair files first: a bad row is a ConfigError, as in `posttrain rm`."""
    if cfg.rm.kind == "prm":  # its rows were checked by preflight_rm; the plan is of pairwise runs only
        raise ConfigError(
            "posttrain explain rm plans pairwise runs only; rm.kind=prm has no plan yet (its rows were checked: "
            "they are valid). Run `posttrain rm rm.kind=prm ...` with rm.max_steps=2 to check it end to end"
        )
    if not cfg.data.train_files:
        raise ConfigError(
            "posttrain rm needs preference pairs: set data.train_files=[pairs.jsonl]; docs/reward-models.md"
        )
    load_pairs(cfg, cfg.data.train_files)  # bad rows are reported before the tokenizer loads
    load_pairs(cfg, cfg.data.val_files)
    tokenizer = run_tokenizer(cfg)
    train, kept = count_pairs(cfg, cfg.data.train_files, tokenizer, training=True)
    val, _ = count_pairs(cfg, cfg.data.val_files, tokenizer)
    plan = batch_plan(cfg, train.kept, world_size)
    shape = ModelShape.from_path(model_config) if model_config else shape_for_model_path(cfg.model.path)
    memory = None
    if shape is not None:
        longest = max(train.longest_tokens, val.longest_tokens)
        packed = None
        if cfg.model.use_remove_padding and plan.pairs_per_micro:
            packed = packed_micro_batch_tokens(cfg, kept, plan.pairs_per_micro)
        memory = memory_estimate(cfg, shape, plan, longest, packed)
        memory = {**asdict(memory), "peak": memory.peak, "model": shape.name}
    return {"train_pairs": asdict(train), "val_pairs": asdict(val), "batch": asdict(plan), "memory": memory}


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB" if n < 2**30 else f"{n / 2**30:,.2f} GiB"


def _micro_line(cfg: PostTrainConfig, b: dict) -> str:
    if b["token_budget"]:
        return (
            f"  micro-batches by token budget: whole pairs, <= {b['token_budget']} tokens each "
            "(rm.use_dynamic_bsz=true, rm.max_token_len_per_gpu); their count varies with the lengths; the "
            "gradient does not depend on it"
        )
    each = " on each rank" if b["ranks"] > 1 else ""
    return (
        f"  micro-batch: {b['pairs_per_micro']} pairs = {2 * b['pairs_per_micro']} sequences per forward/backward{each} "
        f"(rm.micro_batch_size_per_gpu={cfg.rm.micro_batch_size_per_gpu}) -> {b['accumulation_steps']} "
        f"gradient-accumulation step(s){each} per optimizer step; the gradient does not depend on it"
    )


def _tokens_note(cfg: PostTrainConfig, b: dict) -> str:
    """What the activations' token count is."""
    n = 2 * b["pairs_per_micro"]
    if not n:
        return ")"
    if cfg.model.use_remove_padding:
        return (
            f": the {n} texts of the {b['pairs_per_micro']} longest pairs packed into rows of <= "
            f"{cfg.model.remove_padding_max_row_tokens}, model.use_remove_padding)"
        )
    return f": {n} sequences padded to the longest)"


def _ranks_lines(b: dict) -> list[str]:
    """How a step's pairs are spread over the data-parallel ranks (nothing on one device)."""
    if b["ranks"] == 1:
        return []
    return [
        f"  data-parallel ranks: {b['ranks']} (the processes torchrun starts; the model sharded with FSDP2): each "
        f"trains {b['pairs_per_rank']} pairs = {2 * b['pairs_per_rank']} sequences of every step "
        f"(rm.batch_size / {b['ranks']}); the loss is normalised over all ranks' pairs"
    ]


def rm_plan_lines(cfg: PostTrainConfig, plan: dict) -> list[str]:
    """The plan as text."""
    r, t = cfg.rm, cfg.trainer
    tr, va, b, m = plan["train_pairs"], plan["val_pairs"], plan["batch"], plan["memory"]
    lines = [
        "posttrain rm: Bradley-Terry reward model ("
        + (f"{b['ranks']} data-parallel ranks" if b["ranks"] > 1 else "one device")
        + "; docs/reward-models.md)",
        f"  training pairs: {tr['kept']} of {tr['read']} kept ({tr['read'] - tr['kept']} longer than "
        f"rm.max_length={r.max_length}), longest text {tr['longest_tokens']} tokens: {cfg.data.train_files}",
        f"  held-out pairs: {va['kept']} of {va['read']} kept"
        + (f", validated every trainer.test_freq={t.test_freq} steps" if va["kept"] and t.test_freq else ""),
        f"  optimizer step: rm.batch_size={b['pairs_per_step']} pairs = {2 * b['pairs_per_step']} sequences "
        "(chosen and rejected)",
        *_ranks_lines(b),
        _micro_line(cfg, b),
        f"  steps: {b['steps_per_epoch']} per epoch ({b['pairs_left_out_per_epoch']} pairs left out of each "
        f"epoch's shuffle) x rm.epochs={r.epochs}"
        + (f", capped by rm.max_steps={r.max_steps}" if r.max_steps else "")
        + f" = {b['total_steps']} optimizer steps",
    ]
    if m is None:
        lines.append(
            f"  (no memory estimate: model.path={cfg.model.path!r} has no config.json; pass --model-config)"
        )
        return lines
    lines += [
        f"  memory estimate ({m['model']}, {m['parameters'] / 1e6:,.1f}M parameters, {m['trainable_parameters'] / 1e6:,.1f}M "
        f"trained, model.dtype={cfg.model.dtype}):",
        ("    per rank, model states sharded over the ranks: " if b["ranks"] > 1 else "    ")
        + f"weights {_mib(m['weights'])}, gradients {_mib(m['gradients'])}, AdamW moments {_mib(m['optimizer'])}, "
        f"activations {_mib(m['activations'])} ({m['micro_batch_tokens']} tokens" + _tokens_note(cfg, b),
        f"    peak about {_mib(m['peak'])} (weights + moments + the larger of activations and gradients)",
    ]
    return lines
