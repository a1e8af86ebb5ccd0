"""A distillation teacher behind an OpenAI-compatible server (``distill.teacher.base_url``): the log-probs of the
student's sampled tokens from the legacy completions endpoint, one request per sample, the prompt given as the
sample's token ids (prompt + response, exactly the student's) with ``echo=true``, ``logprobs=1`` and
``max_tokens=0``: the reply's ``token_logprobs`` are each prompt token's log-prob given the tokens before it
(docs/distillation.md, "A remote teacher").

The HTTP tries, timeouts and retries are :class:`posttrain.utils.json_endpoint.JsonEndpoint`'s; a sample whose
tries all fail stops the run (:class:`RemoteTeacherUnavailable`, naming the endpoint): a step without its
teacher's scores cannot be trained on correctly.
"""

from __future__ import annotations

import json
import math
import os
from concurrent.futures import ThreadPoolExecutor

import torch

from posttrain.config.errors import ConfigError
from posttrain.config.schema import PostTrainConfig
from posttrain.config.schema.distill import TeacherConfig
from posttrain.data.batch import RolloutBatch
from posttrain.utils.json_endpoint import CallFailed, JsonEndpoint


class RemoteTeacherUnavailable(ConfigError):
    """A sample's request failed all its tries: a clean stop with one message (the CLI's exit 2)."""


class RemoteTeacher:
    """The teacher at ``distill.teacher.base_url``, scoring a batch's samples ``max_concurrency`` at a time."""

    def __init__(self, t: TeacherConfig) -> None:
        api_key = os.environ.get(t.api_key_env, "") if t.api_key_env else ""
        url = t.base_url.rstrip("/") + "/completions"
        self.http = JsonEndpoint(url, api_key, t.timeout_s, t.max_retries, t.backoff_s)
        self.model = t.model
        self.max_concurrency = t.max_concurrency
        self._logged = (0, 0, 0)  # (requests, retries, failures) already reported

    def scores(self, batch: RolloutBatch, temperature: float) -> torch.Tensor:
        """``[B, R]`` float32: each response token's log-prob under the teacher at ``temperature``; 0 on pads."""
        rows = [_row_ids(batch, i) for i in range(batch.num_rows)]
        pool = ThreadPoolExecutor(max_workers=min(self.max_concurrency, max(len(rows), 1)))
        try:
            answers = list(pool.map(lambda row: self._score_row(*row, temperature), rows))
        finally:  # after a sample failed for good, the samples not yet sent are not sent
            pool.shutdown(wait=True, cancel_futures=True)
        out = torch.zeros(batch.num_rows, batch.response_width, dtype=torch.float32)
        for i, values in enumerate(answers):
            out[i, : len(values)] = torch.tensor(values, dtype=torch.float32)
        return out.to(batch.input_ids.device)

    def metrics(self) -> dict[str, float]:
        """``distill/remote/*``: requests sent, retries and failed samples since the last call."""
        now = (self.http.requests, self.http.retries, self.http.failures)
        delta = [a - b for a, b in zip(now, self._logged)]
        self._logged = now
        return {f"distill/remote/{k}": float(v) for k, v in zip(("requests", "retries", "failures"), delta)}

    def _score_row(self, prompt: list[int], response: list[int], temperature: float) -> list[float]:
        body = {
            "model": self.model,
            "prompt": prompt + response,
            "echo": True,
            "logprobs": 1,
            "max_tokens": 0,
            "temperature": temperature,
        }
        try:
            return self.http.call(body, lambda raw: response_logprobs(raw, len(prompt), len(response)))
        except CallFailed as exc:
            raise RemoteTeacherUnavailable(
                f"the remote teacher {self.http.url} (distill.teacher.base_url, model {self.model!r}) failed a "
                f"sample's request {self.http.max_retries + 1} times; the last error: {exc}. Check that the "
                "server is up, serves that model and answers completions with echo=true and logprobs, or raise "
                "distill.teacher.timeout_s / distill.teacher.max_retries"
            ) from None


def remote_teacher(cfg: PostTrainConfig) -> RemoteTeacher | None:
    """The remote teacher of ``distill.teacher.base_url``; None when it is empty."""
    return RemoteTeacher(cfg.distill.teacher) if cfg.distill.teacher.base_url else None


def _row_ids(batch: RolloutBatch, i: int) -> tuple[list[int], list[int]]:
    """Row ``i``'s prompt ids (left pads dropped) and response ids (right pads dropped)."""
    mask = batch.attention_mask[i].bool()
    p = batch.prompt_width
    prompt = batch.input_ids[i, :p][mask[:p]].tolist()
    response = batch.input_ids[i, p:][mask[p:]].tolist()
    return prompt, response


def response_logprobs(raw: bytes, n_prompt: int, n_response: int) -> list[float]:
    """The response tokens' log-probs in a completions reply echoing ``n_prompt + n_response`` tokens (a server
    that generated one token anyway adds one entry, ignored); CallFailed naming what is wrong otherwise."""
    try:
        values = json.loads(raw)["choices"][0]["logprobs"]["token_logprobs"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise CallFailed(f"the reply holds no choices[0].logprobs.token_logprobs: {raw[:200]!r}") from None
    n = n_prompt + n_response
    if not isinstance(values, list) or len(values) not in (n, n + 1):
        got = len(values) if isinstance(values, list) else type(values).__name__
        raise CallFailed(f"the reply has {got} token log-probs for a prompt of {n} tokens")
    picked = values[n_prompt:n]
    if not all(isinstance(v, (int, float)) and not math.isnan(v) and v <= 1e-3 for v in picked):
        raise CallFailed(f"the reply's response log-probs are not all log-probs (numbers <= 0): {picked[:8]}")
    return [float(v) for v in picked]
