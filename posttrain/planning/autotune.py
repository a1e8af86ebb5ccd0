"""`posttrain tune`: measure real steps at growing micro-batch sizes (or token budgets) and keep the fastest
setting that fits under a memory cap.

For each role (actor update, old-log-prob forward; critic update and values forward when the config trains a
critic) the candidates are tried smallest first, each in a fresh process (:mod:`posttrain.planning.measure`):
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
from functools import partial

from posttrain.config.errors import ConfigError
from posttrain.config.plan import BatchPlan
from posttrain.config.schema import PostTrainConfig
from posttrain.planning.measure import TrialResult, TrialSpec, run_trial_in_subprocess
from posttrain.planning.shape import GIB

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
    wanted = roles or ["actor", "old_log_prob"] + (["critic", "values"] if plan.critic is not None else [])
    return [_role_target(role, cfg, plan, max_micro, max_rows) for role in wanted]


# role -> (its plan, an update (not a forward pass)?, micro-batch size key, token budget key)
_ROLE_KNOBS = {
    "actor": ("actor", True, "actor.ppo_micro_batch_size_per_gpu", "actor.ppo_max_token_len_per_gpu"),
    "old_log_prob": (
        "old_log_prob",
        False,
        "actor.log_prob_micro_batch_size_per_gpu",
        "actor.log_prob_max_token_len_per_gpu",
    ),
    "critic": ("critic", True, "critic.ppo_micro_batch_size_per_gpu", "critic.ppo_max_token_len_per_gpu"),
    "values": (
        "values",
        False,
        "critic.forward_micro_batch_size_per_gpu",
        "critic.forward_max_token_len_per_gpu",
    ),
}


def _role_target(
    role: str, cfg: PostTrainConfig, plan: BatchPlan, max_micro: int | None, max_rows: int | None
) -> Target:
    if role not in _ROLE_KNOBS:
        raise ConfigError(f"--roles {role!r}: choose from actor, old_log_prob, critic, values")
    if role in ("critic", "values") and plan.critic is None:
        raise ConfigError(
            f"--roles {role}: this config trains no critic (algorithm.adv_estimator="
            f"{cfg.algorithm.adv_estimator}); use algorithm.adv_estimator=gae or drop {role}"
        )
    plan_name, is_update, micro_key, budget_key = _ROLE_KNOBS[role]
    target = _update_target if is_update else _forward_target
    return target(
        role, getattr(plan, plan_name), micro_key, budget_key, plan.max_seq_len, max_micro, max_rows
    )


def _update_target(
    role: str, p, micro_key: str, budget_key: str, seq: int, max_micro: int | None, max_rows: int | None
) -> Target:
    """An update's candidates: token budgets up to its mini-batch, or micro-batch sizes dividing it."""
    if p.use_dynamic_bsz:
        values = [seq * k for k in BUDGET_MULTIPLES]
        rows = max(1, min(max_rows or 10**9, p.mini_batch_samples_per_rank, values[-1] // seq))
        values = [v for v in values if v <= rows * seq]
        return Target(role, budget_key, tuple(values), True, rows)
    per_rank = p.mini_batch_samples_per_rank
    values = [v for v in _powers_of_two(per_rank) if per_rank % v == 0] + [per_rank]  # rule 3 of the plan
    values = sorted({v for v in values if v <= (max_micro or per_rank)})
    return Target(role, micro_key, tuple(values), False, min(max(values), max_rows or per_rank))


def _forward_target(
    role: str, p, micro_key: str, budget_key: str, seq: int, max_micro: int | None, max_rows: int | None
) -> Target:
    """A forward pass's candidates: token budgets or micro-batch sizes up to its samples per rank."""
    if p.use_dynamic_bsz:
        rows = max(1, min(max_rows or 10**9, p.samples_per_rank))
        values = [seq * k for k in BUDGET_MULTIPLES if seq * k <= rows * seq]
        return Target(role, budget_key, tuple(values), True, rows)
    values = sorted({*_powers_of_two(p.samples_per_rank), p.samples_per_rank})
    values = [v for v in values if v <= (max_micro or p.samples_per_rank)]
    return Target(role, micro_key, tuple(values), False, min(max(values), max_rows or p.samples_per_rank))


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
    d = cfg.data
    search = _Search(
        limit=int(memory_cap_bytes * (1 - headroom)),
        memory_cap_bytes=memory_cap_bytes,
        time_budget_s=time_budget_s,
        start=time.monotonic(),
        estimate=estimate,
        runner=runner,
        progress=progress,
        spec=partial(
            TrialSpec,
            model_config=model_config,
            overrides=tuple(overrides),
            prompt_len=d.max_prompt_length,
            response_len=d.max_response_length,
            repeats=repeats,
            device=device,
            threads=threads,
            memory_cap_bytes=memory_cap_bytes,
        ),
    )
    trials = search.result.trials
    for index, target in enumerate(targets):
        # Each remaining role gets an equal share of the remaining trials, so the last role is not starved.
        share = max(1, (max_trials - len(trials)) // (len(targets) - index))
        best = search.best_setting(target, role_limit=min(max_trials, len(trials) + share))
        if best is not None:
            search.result.best[target.key] = best
    return search.result


@dataclass
class _Search:
    """What the searches of all roles share: the memory limit, the clock, how a trial runs, the trials so far."""

    limit: int  # bytes a trial's peak must stay under
    memory_cap_bytes: int
    time_budget_s: float
    start: float  # time.monotonic() when the search began
    estimate: Callable[[Target, int], int | None] | None
    runner: Callable[[TrialSpec], TrialResult]
    progress: Callable[[str], None]
    spec: Callable[..., TrialSpec]  # TrialSpec with the fields every trial shares already given
    result: TuneResult = field(default_factory=TuneResult)

    def best_setting(self, target: Target, role_limit: int) -> Trial | None:
        """Try ``target``'s candidates smallest first; the fastest that fits, or None if none was measured to fit.

        Stops at ``role_limit`` trials in all, at the time budget, at a candidate estimated far above the cap,
        at the first one that does not fit, or after ``PLATEAU_TRIALS`` without a ``PLATEAU_GAIN`` speed-up.
        """
        best: Trial | None = None
        stale = 0
        for value in target.candidates:
            elapsed = time.monotonic() - self.start
            if len(self.result.trials) >= role_limit or elapsed >= self.time_budget_s:
                self.progress(
                    f"stopping: {len(self.result.trials)} trials, {elapsed:.0f} s used (--max-trials / --time-budget-s)"
                )
                break
            predicted = self.estimate(target, value) if self.estimate else None
            if predicted is not None and predicted > SKIP_FACTOR * self.memory_cap_bytes:
                self.progress(
                    f"{target.key}={value}: skipped, estimated {predicted / GIB:.2f} GiB > {SKIP_FACTOR} x cap"
                )
                break
            trial = self._measure(target, value, predicted)
            if not trial.fits:
                break  # larger settings need more memory
            speed = trial.result.tokens_per_s
            if best is None or speed > best.result.tokens_per_s * (1 + PLATEAU_GAIN):
                best, stale = trial, 0
            else:
                if speed > best.result.tokens_per_s:
                    best = trial
                stale += 1
                if stale >= PLATEAU_TRIALS:
                    self.progress(
                        f"  {target.key}: no gain over {PLATEAU_TRIALS} larger settings; stopping this role"
                    )
                    break
        return best

    def _measure(self, target: Target, value: int, predicted: int | None) -> Trial:
        """Run one trial of ``target`` at ``value``, record it and report it."""
        spec = self.spec(
            role=target.role,
            rows=target.rows,
            micro_batch_size=None if target.dynamic else value,
            max_tokens=value if target.dynamic else None,
        )
        self.progress(
            f"trial {len(self.result.trials) + 1}: {target.role} {target.key}={value} ({target.rows} samples) ..."
        )
        res = self.runner(spec)
        fits = res.status == "ok" and res.peak_bytes is not None and res.peak_bytes <= self.limit
        trial = Trial(target, value, res, fits, predicted)
        self.result.trials.append(trial)
        speed = f"{res.tokens_per_s:,.0f} tokens/s" if res.tokens_per_s else res.status
        peak = f"{res.peak_bytes / GIB:.3f} GiB" if res.peak_bytes is not None else "-"
        self.progress(f"  -> {speed}, peak {peak}, {'fits' if fits else 'does not fit'} {res.error}".rstrip())
        return trial
