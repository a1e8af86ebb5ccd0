"""`posttrain tune`: measure real steps at growing micro-batch sizes (or token budgets) and keep the fastest
setting that fits under a memory cap.

For each role (actor update, old-log-prob forward; critic update and values forward when the config trains a
critic) the candidates are tried smallest first, each in a fresh process (:mod:`posttrain.tools.measure`):
every trial processes the same samples (one mini-batch per rank, capped by ``rows``), so tokens/s compare
like for like. The search stops growing a role at the first out-of-memory / over-cap trial, after
``PLATEAU_TRIALS`` trials without a ``PLATEAU_GAIN`` improvement, or when its share of the trials (the remaining
trials split equally over the remaining roles) or the time budget runs out.
Candidates the estimator predicts far above the cap are skipped without running.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from posttrain.config.errors import ConfigError
from posttrain.config.plan import BatchPlan
from posttrain.config.schema import PostTrainConfig
from posttrain.tools.measure import TrialResult, TrialSpec, run_trial_in_subprocess
from posttrain.tools.shape import GIB

PLATEAU_GAIN = 0.03  # a larger setting must be at least 3% faster to count as an improvement
PLATEAU_TRIALS = 2
SKIP_FACTOR = 1.5  # skip a candidate the estimator puts above 1.5 x the cap (it would surely not fit)
BUDGET_MULTIPLES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)


@dataclass(frozen=True)
class Target:
    """One role's knob and the values to try (ascending)."""

    role: str  # a measure.ROLES name
    key: str  # the config key the value goes to
    candidates: tuple[int, ...]
    dynamic: bool  # token budgets (use_dynamic_bsz) instead of micro-batch sizes
    rows: int  # samples per measured step


@dataclass
class Trial:
    target: Target
    value: int
    result: TrialResult
    fits: bool
    estimate_bytes: int | None = None


@dataclass
class TuneResult:
    trials: list[Trial] = field(default_factory=list)
    best: dict[str, Trial] = field(default_factory=dict)  # by config key

    def overlay(self) -> dict:
        """Only the tuned keys, nested by section (a YAML overlay `posttrain train` accepts)."""
        out: dict = {}
        for key, trial in self.best.items():
            section, name = key.split(".")
            out.setdefault(section, {})[name] = trial.value
        return out


def _powers_of_two(limit: int) -> list[int]:
    out, v = [], 1
    while v <= limit:
        out.append(v)
        v *= 2
    return out


def tune_targets(
    cfg: PostTrainConfig,
    plan: BatchPlan,
    roles: list[str] | None = None,
    max_micro: int | None = None,
    max_rows: int | None = None,
) -> list[Target]:
    """The knob and candidate values of each role the config uses (valid for the plan by construction)."""
    seq = plan.max_seq_len
    out: list[Target] = []

    def update(role: str, p, micro_key: str, budget_key: str) -> None:
        if p.use_dynamic_bsz:
            values = [seq * k for k in BUDGET_MULTIPLES]
            rows = max(1, min(max_rows or 10**9, p.mini_batch_samples_per_rank, values[-1] // seq))
            values = [v for v in values if v <= rows * seq]
            out.append(Target(role, budget_key, tuple(values), True, rows))
            return
        per_rank = p.mini_batch_samples_per_rank
        values = [v for v in _powers_of_two(per_rank) if per_rank % v == 0] + [per_rank]  # rule 3 of the plan
        values = sorted({v for v in values if v <= (max_micro or per_rank)})
        out.append(Target(role, micro_key, tuple(values), False, min(max(values), max_rows or per_rank)))

    def forward(role: str, p, micro_key: str, budget_key: str) -> None:
        if p.use_dynamic_bsz:
            rows = max(1, min(max_rows or 10**9, p.samples_per_rank))
            values = [seq * k for k in BUDGET_MULTIPLES if seq * k <= rows * seq]
            out.append(Target(role, budget_key, tuple(values), True, rows))
            return
        values = sorted({*_powers_of_two(p.samples_per_rank), p.samples_per_rank})
        values = [v for v in values if v <= (max_micro or p.samples_per_rank)]
        out.append(
            Target(role, micro_key, tuple(values), False, min(max(values), max_rows or p.samples_per_rank))
        )

    wanted = roles or ["actor", "old_log_prob"] + (["critic", "values"] if plan.critic is not None else [])
    for role in wanted:
        if role == "actor":
            update(role, plan.actor, "actor.ppo_micro_batch_size_per_gpu", "actor.ppo_max_token_len_per_gpu")
        elif role == "old_log_prob":
            forward(
                role,
                plan.old_log_prob,
                "actor.log_prob_micro_batch_size_per_gpu",
                "actor.log_prob_max_token_len_per_gpu",
            )
        elif role in ("critic", "values"):
            if plan.critic is None:
                raise ConfigError(
                    f"--roles {role}: this config trains no critic (algorithm.adv_estimator="
                    f"{cfg.algorithm.adv_estimator}); use algorithm.adv_estimator=gae or drop {role}"
                )
            if role == "critic":
                update(
                    role,
                    plan.critic,
                    "critic.ppo_micro_batch_size_per_gpu",
                    "critic.ppo_max_token_len_per_gpu",
                )
            else:
                forward(
                    role,
                    plan.values,
                    "critic.forward_micro_batch_size_per_gpu",
                    "critic.forward_max_token_len_per_gpu",
                )
        else:
            raise ConfigError(f"--roles {role!r}: choose from actor, old_log_prob, critic, values")
    return out


def autotune(
    cfg: PostTrainConfig,
    targets: list[Target],
    model_config: dict,
    overrides: list[str],
    *,
    memory_cap_bytes: int,
    headroom: float = 0.1,
    time_budget_s: float = 300.0,
    max_trials: int = 12,
    device: str = "cpu",
    threads: int = 1,
    repeats: int = 2,
    estimate: Callable[[Target, int], int | None] | None = None,
    runner: Callable[[TrialSpec], TrialResult] = run_trial_in_subprocess,
    progress: Callable[[str], None] = print,
) -> TuneResult:
    """Measure each target's candidates (see the module doc) and pick the fastest that fits.

    ``memory_cap_bytes`` x (1 - ``headroom``) is the limit a trial's peak must stay under. ``estimate(target,
    value)`` (bytes, optional) lets the search skip candidates predicted above ``SKIP_FACTOR`` x the cap.
    """
    if not 0 <= headroom < 1:
        raise ConfigError(f"--headroom ({headroom}) must be in [0, 1): the fraction of the cap kept free")
    limit = int(memory_cap_bytes * (1 - headroom))
    result = TuneResult()
    start = time.monotonic()
    d = cfg.data
    for index, target in enumerate(targets):
        best: Trial | None = None
        stale = 0
        # Each remaining role gets an equal share of the remaining trials, so the last role is not starved.
        share = max(1, (max_trials - len(result.trials)) // (len(targets) - index))
        role_limit = min(max_trials, len(result.trials) + share)
        for value in target.candidates:
            elapsed = time.monotonic() - start
            if len(result.trials) >= role_limit or elapsed >= time_budget_s:
                progress(
                    f"stopping: {len(result.trials)} trials, {elapsed:.0f} s used (--max-trials / --time-budget-s)"
                )
                break
            predicted = estimate(target, value) if estimate else None
            if predicted is not None and predicted > SKIP_FACTOR * memory_cap_bytes:
                progress(
                    f"{target.key}={value}: skipped, estimated {predicted / GIB:.2f} GiB > {SKIP_FACTOR} x cap"
                )
                break
            spec = TrialSpec(
                role=target.role,
                model_config=model_config,
                overrides=tuple(overrides),
                prompt_len=d.max_prompt_length,
                response_len=d.max_response_length,
                rows=target.rows,
                micro_batch_size=None if target.dynamic else value,
                max_tokens=value if target.dynamic else None,
                repeats=repeats,
                device=device,
                threads=threads,
                memory_cap_bytes=memory_cap_bytes,
            )
            progress(
                f"trial {len(result.trials) + 1}: {target.role} {target.key}={value} ({target.rows} samples) ..."
            )
            res = runner(spec)
            fits = res.status == "ok" and res.peak_bytes is not None and res.peak_bytes <= limit
            trial = Trial(target, value, res, fits, predicted)
            result.trials.append(trial)
            speed = f"{res.tokens_per_s:,.0f} tokens/s" if res.tokens_per_s else res.status
            peak = f"{res.peak_bytes / GIB:.3f} GiB" if res.peak_bytes is not None else "-"
            progress(f"  -> {speed}, peak {peak}, {'fits' if fits else 'does not fit'} {res.error}".rstrip())
            if not fits:
                break  # larger settings need more memory
            if best is None or res.tokens_per_s > best.result.tokens_per_s * (1 + PLATEAU_GAIN):
                best, stale = trial, 0
            else:
                if res.tokens_per_s > best.result.tokens_per_s:
                    best = trial
                stale += 1
                if stale >= PLATEAU_TRIALS:
                    progress(
                        f"  {target.key}: no gain over {PLATEAU_TRIALS} larger settings; stopping this role"
                    )
                    break
        if best is not None:
            result.best[target.key] = best
    return result
