"""What a harness run trains is what the policy sampled, in the context it sampled it in:

- the trainer's recomputed log-probs (``policy_logprobs``) of every mask-1 token of every captured call match the
  engine's to 1e-5 (fp32, the native engine), and the mask-0 tokens (template, user) get exactly zero gradient;
- a harness that rewrites its history is a counted prefix break and, with harness.on_prefix_break=last, its sample
  is the last chain's tokens only: every mask-1 id is one the engine sampled for that chain's calls.
"""

import openai
import torch

from posttrain.agents.render import Renderer
from posttrain.config.schema.harness import HarnessConfig
from posttrain.data.records import PromptRecord
from posttrain.forward.passes import policy_logprobs
from posttrain.gateway.assemble import PREFIX_BREAKS
from posttrain.gateway.harness import CallableHarness
from posttrain.gateway.server import Gateway
from posttrain.models.hf import load_causal_lm
from posttrain.rl.collect.generation import Scored, scored_batch
from posttrain.rl.collect.harness_loop import HarnessLoop
from posttrain.rollout.base import SamplingParams
from tests.gateway.support import make_engine
from tests.helpers import response_logit_grads

RECORDS = [PromptRecord("What is 2+2?", "4"), PromptRecord("Name a colour.", "red")]
PARAMS = SamplingParams(max_tokens=40, n=3, seed=11)


def chat(base_url, api_key, messages, max_tokens=6):
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    return client.chat.completions.create(model="policy", messages=messages, max_tokens=max_tokens)


def three_turns(row, base_url, api_key):
    """Appends: ask, then two follow-ups on the answers (template and user tokens between the calls)."""
    messages = [{"role": "user", "content": row["prompt"]}]
    for follow_up in ("Sure?", "Once more."):
        reply = chat(base_url, api_key, messages)
        messages += [
            reply.choices[0].message.model_dump(exclude_none=True),
            {"role": "user", "content": follow_up},
        ]
    chat(base_url, api_key, messages)


def drops_the_first_answer(row, base_url, api_key):
    """Rewrites: its third call leaves out the first assistant turn (a prefix break), its fourth appends to it."""
    first = [{"role": "user", "content": row["prompt"]}]
    answer = chat(base_url, api_key, first).choices[0].message.content or ""
    history = [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": "Sure?"}]
    chat(base_url, api_key, history)
    trimmed = [*first, {"role": "user", "content": "Sure?"}]  # the first answer is gone
    again = chat(base_url, api_key, trimmed).choices[0].message.content or ""
    chat(
        base_url,
        api_key,
        [*trimmed, {"role": "assistant", "content": again}, {"role": "user", "content": "Go on."}],
    )


class Recording(Gateway):
    """The real gateway, keeping each closed session's CallRecords (the loop hands them to assembly)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.sample_of, self.closed_records = {}, {}

    def open_session(self, *, sample_id, **kwargs):
        handle = super().open_session(sample_id=sample_id, **kwargs)
        self.sample_of[handle.id] = sample_id
        return handle

    def close_session(self, session_id):
        records = super().close_session(session_id)
        self.closed_records[self.sample_of[session_id]] = records
        return records


def harness_run(model, tok, fn, **settings):
    """The loop's rollout of RECORDS through ``fn``; (result, each sample's CallRecords in sample order)."""
    gateways = []

    def make_gateway(backend):
        gateways.append(Recording(backend, tok, max_model_len=512))
        return gateways[-1]

    loop = HarnessLoop(
        CallableHarness(fn, fn.__name__),
        HarnessConfig(**settings),
        tok,
        64,
        0,
        make_gateway,
        {tok.eos_token_id},
    )
    result = loop.generate(make_engine(model, tok), RECORDS, PARAMS)
    loop.close()
    return result, [gateways[0].closed_records[e.sample_id] for e in result.episodes]


def test_trainer_log_probs_match_the_engine_on_every_captured_call(model, tok):
    result, records = harness_run(model, tok, three_turns)
    assert all(len(calls) == 3 and all(c.extends_previous for c in calls[1:]) for calls in records)
    assert all(e.metrics[PREFIX_BREAKS] == 0.0 for e in result.episodes)
    batch = scored_batch(Scored(result, torch.zeros(len(result))), [], tok.pad_token_id, None, True)
    with torch.no_grad():
        trainer, _ = policy_logprobs(model, batch, temperature=1.0)
    on = batch.response_mask == 1
    assert on.sum() == sum(len(c.completion_ids) for calls in records for c in calls)  # every call's ids
    assert torch.allclose(trainer[on], batch.rollout_log_probs[on], atol=1e-5, rtol=0)
    assert torch.all(batch.rollout_log_probs[~on] == 0)
    engine = sorted(lp for calls in records for c in calls for lp in c.logprobs)
    assert torch.equal(torch.tensor(engine), batch.rollout_log_probs[on].sort().values)  # the records' own


def test_template_tokens_get_zero_gradient(tiny_model_dir, tok):
    model = load_causal_lm(tiny_model_dir).float()  # its own copy: a hook is added to it
    result, _ = harness_run(model, tok, three_turns)
    batch, grad, _ = response_logit_grads(model, result, tok.pad_token_id)
    mask = batch.response_mask
    assert (mask == 0).any()
    width_p = batch.input_ids.shape[1] - mask.shape[1]
    template = (mask == 0) & (batch.attention_mask[:, width_p:] == 1)
    assert template.any() and torch.all(grad[template] == 0)
    assert grad[mask == 1].abs().sum() > 0


def test_a_rewritten_history_trains_only_the_last_chain_of_sampled_ids(model, tok):
    result, records = harness_run(model, tok, drops_the_first_answer, on_prefix_break="last")
    renderer = Renderer(tok)
    for e, calls in zip(result.episodes, records):
        assert [c.extends_previous for c in calls] == [False, True, False, True]
        assert e.metrics[PREFIX_BREAKS] == 1.0 and e.num_assistant_turns == 2
        last = calls[2:]
        assert e.prompt_ids == last[0].prompt_ids == renderer.prompt_ids(last[0].messages)
        trained = [t for t, m in zip(e.response_ids, e.mask) if m == 1]
        assert trained == last[0].completion_ids + last[1].completion_ids  # sampled ids only, in order
        assert e.prompt_ids + e.response_ids == last[1].prompt_ids + last[1].completion_ids
        assert e.messages[1]["content"] == "Sure?"  # the reward function reads the last chain's messages


def edits_a_result(row, base_url, api_key):
    """Rewrites: its third call edits the result message its second call sent (answered since)."""
    messages = [{"role": "user", "content": row["prompt"]}]
    answer = chat(base_url, api_key, messages).choices[0].message.content or ""
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "result: 1"}]
    again = chat(base_url, api_key, messages).choices[0].message.content or ""
    messages[-1] = {"role": "user", "content": "result: 2"}  # the harness corrects its tool's output
    chat(
        base_url,
        api_key,
        [*messages, {"role": "assistant", "content": again}, {"role": "user", "content": "?"}],
    )


def test_an_edited_earlier_message_is_a_break(model, tok):
    result, records = harness_run(model, tok, edits_a_result, on_prefix_break="last")
    for e, calls in zip(result.episodes, records):
        assert [c.extends_previous for c in calls] == [False, True, False]
        assert e.metrics[PREFIX_BREAKS] == 1.0 and e.num_assistant_turns == 1
        assert [t for t, m in zip(e.response_ids, e.mask) if m == 1] == calls[-1].completion_ids
        assert e.prompt_ids == calls[-1].prompt_ids
