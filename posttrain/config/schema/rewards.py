"""Reward functions and the optional reward model."""

from __future__ import annotations

from dataclasses import dataclass

from posttrain.config.fields import knob, section
from posttrain.config.schema.names import DTYPES


@dataclass
class RewardModelConfig:
    """An optional Hugging Face sequence-classification reward model."""

    enable: bool = knob(False, "Score responses with the reward model at `path`.")
    path: str = knob("", "Local directory of an AutoModelForSequenceClassification with one label.")
    weight: float = knob(
        1.0,
        "Weight of the reward model's score in the reward trained on (reward.rule_weight * rule + "
        "reward.model.weight * score); logged apart as reward/model_score_mean.",
    )
    normalize: bool = knob(
        False,
        "Normalise the score with the reward_mean and reward_std stored in the model's config (`posttrain rm` "
        "writes them) before weighting: (score - reward_mean) / reward_std.",
    )
    micro_batch_size_per_gpu: int = knob(
        32, "Samples per reward-model forward pass.", unit="samples per DP rank", min=1
    )
    use_dynamic_bsz: bool = knob(False, "Form reward-model micro-batches by token budget.")
    dtype: str | None = knob(
        None,
        "Parameter and compute dtype of the reward model; null: the same as model.dtype.",
        choices=DTYPES,
    )
    remove_padding_max_row_tokens: int | None = knob(
        None,
        "Row length of packed reward-model inputs; null: the same as model.remove_padding_max_row_tokens.",
        unit="tokens",
        min=1,
    )
    use_remove_padding: bool = knob(
        False,
        "Pack reward-model inputs into rows of reward.model.remove_padding_max_row_tokens tokens (no pad tokens "
        "computed); needs an architecture verified for packing (docs/throughput.md).",
    )
    forward_max_token_len_per_gpu: int = knob(
        32768, "Token budget of one reward-model forward pass.", unit="tokens per GPU", min=1
    )


@dataclass
class JudgeConfig:
    """An LLM judge grading each sample on a rubric's criteria: an OpenAI-compatible chat endpoint, or a causal LM
    loaded in the trainer's process (docs/judges.md)."""

    enable: bool = knob(
        False,
        "Score responses on the rubric's criteria with the judge at `base_url` (an endpoint) or `path` (a local "
        "model); exactly one of the two.",
    )
    base_url: str = knob(
        "",
        "OpenAI-compatible API base URL, e.g. http://127.0.0.1:8000/v1 (a vLLM server, `posttrain serve`, a "
        "hosted API); the judge posts to <base_url>/chat/completions. Empty with reward.judge.path set: a "
        "local judge.",
    )
    path: str = knob(
        "",
        "A local judge instead of reward.judge.base_url: a causal-LM directory, a run directory (its "
        "final_model/ is loaded), a Hub id, or builtin:tiny / builtin:base; loaded in each rank's process on "
        "its training device, generating reward.judge.batch_size verdicts per call.",
    )
    batch_size: int = knob(
        8,
        "Verdicts a local judge (reward.judge.path) generates per batched generate() call; the verdicts do not "
        "depend on it.",
        unit="verdicts",
        min=1,
    )
    dtype: str | None = knob(
        None,
        "Parameter and compute dtype of a local judge (reward.judge.path); null: the same as model.dtype.",
        choices=DTYPES,
    )
    model: str = knob(
        "",
        "The model name sent with each request (the endpoint's /v1/models lists them); unused by a local judge.",
    )
    api_key_env: str = knob(
        "",
        "Name of the environment variable holding the API key (sent as a Bearer token); the key itself is "
        "never in the config. Empty: no key sent. A variable that is not set stops the run before any model "
        "loads.",
    )
    rubric: str = knob(
        "",
        "YAML rubric file: weighted criteria, each a prompt template with {prompt}, {response}, {reference} "
        "and {row[KEY]} and a verdict kind (score in a range, grade, yes_no); format in docs/judges.md.",
    )
    weight: float = knob(
        1.0,
        "Weight of the judge's score (in [0, 1], the criteria's weighted mean) in the reward trained on: "
        "reward.rule_weight * rule + reward.model.weight * model score + reward.judge.weight * judge score; "
        "logged apart as reward/judge/score_mean.",
    )
    unparsed_score: float = knob(
        0.0,
        "Score (in [0, 1]) of a criterion whose verdict cannot be read or whose call failed after its retries; "
        "counted as reward/judge/unparsed and reward/judge/failures. Pointwise mode only (pairwise: a tie).",
        min=0.0,
        max=1.0,
    )
    max_concurrency: int = knob(8, "Judge requests in flight at once (per rank).", unit="requests", min=1)
    timeout_s: float = knob(60.0, "Seconds one judge request may take before it is tried again.", min=0.001)
    max_retries: int = knob(
        3, "Tries after a failed request (connection, timeout, HTTP error, not a chat completion).", min=0
    )
    backoff_s: float = knob(
        1.0, "Wait before the first retry; doubled before each further one.", unit="seconds", min=0.0
    )
    max_failures: int = knob(
        32,
        "Failed calls (all tries failed) the run tolerates; one more stops it with a message naming the "
        "endpoint.",
        min=0,
    )
    max_tokens: int = knob(512, "Most tokens the judge may write per verdict.", unit="tokens", min=1)
    temperature: float = knob(0.0, "The judge's sampling temperature (0: greedy, reproducible).", min=0.0)
    cache: bool = knob(
        True,
        "Judge each (criterion, prompt, response, reference) once per run and reuse the verdict "
        "(reward/judge/cached counts the reuses).",
    )
    mode: str = knob(
        "pointwise",
        "pointwise: each sample judged alone on each criterion. pairwise: the samples of one prompt's group "
        "(rollout.n >= 2) compared two at a time, each pair in both orders, a sample scoring its win rate; the "
        "rubric then uses {response_a} / {response_b} and verdict: choice (docs/judges.md, Pairwise mode).",
        choices=("pointwise", "pairwise"),
    )
    pairwise_opponents: int = knob(
        0,
        "With mode=pairwise: 0 compares every pair of a group (n samples: n(n-1) calls per criterion); k > 0 "
        "pairs each sample with the next k samples of its group (about 2nk calls per criterion).",
        min=0,
    )


@dataclass
class ProcessRewardConfig:
    """A process reward model (PRM) scoring each reasoning step of a response (docs/judges.md, "Process
    rewards")."""

    enable: bool = knob(False, "Score each step of the responses with the process reward model at `path`.")
    path: str = knob(
        "",
        "Local directory of an AutoModelForTokenClassification with two labels (1: step correct) whose config "
        "holds step_separator, the text it was trained with after each step.",
    )
    separator: str = knob(
        "",
        "How the policy's response is cut into steps: a string (or a regex with separator_is_regex=true). Empty: "
        "the model's own step_separator. The PRM always reads each step followed by its own step_separator.",
    )
    separator_is_regex: bool = knob(False, "Read reward.prm.separator as a Python regular expression.")
    reduction: str = knob(
        "dense",
        "dense: each step's score on the last token of that step (token-level rewards; needs an estimator that "
        "credits tokens: gae or reinforce_plus_plus); min, mean, last: one score per response from its steps' "
        "scores, on its last token (any estimator).",
        choices=("dense", "min", "mean", "last"),
    )
    weight: float = knob(
        1.0,
        "Weight of the step scores (each in [0, 1]) in the reward trained on, added to reward.rule_weight * rule "
        "(+ the reward model's and the judge's parts); logged apart as reward/prm/mean.",
    )
    micro_batch_size_per_gpu: int = knob(
        32, "Responses per PRM forward pass.", unit="samples per DP rank", min=1
    )
    dtype: str | None = knob(
        None, "Parameter and compute dtype of the PRM; null: the same as model.dtype.", choices=DTYPES
    )


@dataclass
class OverlongBufferConfig:
    """DAPO's overlong reward shaping (verl's `overlong_buffer`): a length penalty over the last `len` tokens
    before data.max_response_length."""

    enable: bool = knob(
        False,
        "Add a penalty to the reward of responses longer than data.max_response_length - len: it grows linearly "
        "from 0 to -penalty_factor at data.max_response_length (training rewards only; validation is unshaped).",
    )
    len: int = knob(
        0,
        "Width of the penalty zone at the end of the response budget; at most data.max_response_length.",
        unit="tokens",
        min=0,
    )
    penalty_factor: float = knob(
        0.0, "The penalty of a response that reaches data.max_response_length.", min=0.0
    )
    log: bool = knob(
        False,
        "Log the shaping each step: reward/overlong_penalty_mean and reward/overlong_fraction (the fraction of "
        "responses penalised).",
    )


@dataclass
class RewardConfig:
    """Rule-based or user reward functions, and the optional reward model."""

    function: str = knob(
        "",
        "Reward function: a built-in name (exact_match, arithmetic, gsm8k, gsm8k_strict, gsm8k_flexible, "
        "math_verify, data_source, code) or 'path/to/file.py:fn'. Empty: the task's own reward, or for files whose "
        "rows have a data_source (verl's layout) the built-in scorer for each row's data_source.",
    )
    timeout_s: float = knob(10.0, "Seconds one reward call may take (0 disables the guard).", min=0.0)
    failure_reward: float = knob(0.0, "Reward given when the function raises or times out.")
    fail_fast: bool = knob(False, "Abort the run on the first reward-function failure.")
    score_during_generation: str = knob(
        "auto",
        "When a step's samples are scored: while the step still generates (each sample as the rollout engine "
        "finishes it, by a background thread) or after generation. auto: while generating for functions that "
        "declare samples_at_once() (the built-in code reward) when generation leaves the scoring CPUs free (the "
        "rollout runs on a GPU, or sandbox.backend=sandbox_fusion runs the code on other hosts), afterwards "
        "otherwise (beside a CPU rollout the sandbox slows generation by more than it saves); always: while "
        "generating for every function (with reward.timeout_s=0 it is then called from a thread other than the "
        "main one: no signal-based timeouts); never: afterwards. A judge behind an endpoint (reward.judge.base_url) "
        "is asked during generation unless never. The rewards and metrics are the same; "
        "reward/wait_s is the time the step waited for rewards after generation (docs/sandbox.md).",
        choices=("auto", "always", "never"),
    )
    rule_weight: float = knob(
        1.0,
        "Weight of the rule or function reward in the reward trained on when a reward model or a judge is "
        "enabled; 0 trains on the reward model or judge alone (the rule still runs: reward/rule_mean, reward/rule_accuracy, and validation).",
    )
    model: RewardModelConfig = section(RewardModelConfig)
    judge: JudgeConfig = section(JudgeConfig)
    prm: ProcessRewardConfig = section(ProcessRewardConfig)
    overlong_buffer: OverlongBufferConfig = section(OverlongBufferConfig)
