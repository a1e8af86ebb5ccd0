"""RewardModelScorer with a tiny reward model built and saved in the test."""

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForSequenceClassification, PreTrainedTokenizerFast

from posttrain.rewards.reward_model import RewardModelScorer

WORDS = "what is one two three plus four five six seven eight nine ten yes no".split()
CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} <end> {% endfor %}"


def save_reward_model(path, num_labels=1, chat_template=None):
    # Llama, not Qwen2: for a qwen2 config, AutoTokenizer swaps a saved word-level tokenizer for the
    # Qwen2 BPE class, which cannot encode this vocabulary.
    specials = ["<pad>", "<unk>", "<user>", "<assistant>", "<end>"]
    vocab = {token: i for i, token in enumerate(specials + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>")
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(path)
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        num_labels=num_labels,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    LlamaForSequenceClassification(config).save_pretrained(path)
    return path


PROMPTS = ["what is one plus two", "what is six", "what is one plus two plus three plus four"]
RESPONSES = [" three", " six yes", " ten"]


def single_forward(scorer, prompt, response):
    ids = scorer.tokenizer(
        scorer.format(prompt, response), add_special_tokens=not scorer.tokenizer.chat_template
    )
    with torch.no_grad():
        return scorer.model(input_ids=torch.tensor([ids["input_ids"]])).logits[0, 0].item()


@pytest.mark.parametrize("chat_template", [None, CHAT_TEMPLATE], ids=["plain", "chat"])
def test_scores_match_unpadded_forward(tmp_path, chat_template):
    scorer = RewardModelScorer(
        save_reward_model(tmp_path / "rm", chat_template=chat_template), micro_batch_size=2
    )
    scores = scorer.score(PROMPTS, RESPONSES)
    expected = [single_forward(scorer, p, r) for p, r in zip(PROMPTS, RESPONSES)]
    assert scores == pytest.approx(expected, abs=1e-5)
    assert len(set(scores)) == 3  # the texts differ, so must the scores


def test_chat_template_renders_conversation(tmp_path):
    scorer = RewardModelScorer(save_reward_model(tmp_path / "rm", chat_template=CHAT_TEMPLATE))
    text = scorer.format([{"role": "user", "content": "what is six"}], "six")
    assert text == "<user> what is six <end> <assistant> six <end> "
    assert scorer.format("what is six", "six") == text


def test_plain_text_is_prompt_plus_response(tmp_path):
    scorer = RewardModelScorer(save_reward_model(tmp_path / "rm"))
    assert scorer.format("what is six", " six") == "what is six six"
    with pytest.raises(ValueError, match="no chat_template"):
        scorer.format([{"role": "user", "content": "x"}], "y")


def test_max_length_keeps_the_end(tmp_path):
    scorer = RewardModelScorer(save_reward_model(tmp_path / "rm"), max_length=3)
    long_prompt = "one two three four five"
    assert scorer.score([long_prompt], [" six"]) == pytest.approx(
        [single_forward(scorer, "four five", " six")], abs=1e-5
    )


def test_rejects_classifier_with_several_labels(tmp_path):
    path = save_reward_model(tmp_path / "rm", num_labels=2)
    with pytest.raises(ValueError, match="num_labels=2; a reward model needs num_labels=1"):
        RewardModelScorer(path)


def test_bad_arguments(tmp_path):
    path = save_reward_model(tmp_path / "rm")
    with pytest.raises(ValueError, match="dtype='float8'"):
        RewardModelScorer(path, dtype="float8")
    with pytest.raises(ValueError, match="2 prompts but 1 responses"):
        RewardModelScorer(path).score(PROMPTS[:2], RESPONSES[:1])


def test_token_budget_batches_give_the_same_scores(tmp_path):
    path = save_reward_model(tmp_path / "rm", chat_template=None)
    fixed = RewardModelScorer(path, micro_batch_size=2).score(PROMPTS, RESPONSES)
    scorer = RewardModelScorer(path, max_tokens=16)
    calls = []
    original = scorer._forward
    scorer._forward = lambda batch: calls.append(sum(len(ids) for ids in batch)) or original(batch)
    assert scorer.score(PROMPTS, RESPONSES) == pytest.approx(fixed, abs=1e-5)
    assert calls and max(calls) <= 16
    with pytest.raises(ValueError, match="max_tokens"):
        RewardModelScorer(path, max_tokens=8, max_length=16)


def test_packed_scoring_equals_padded(tmp_path):
    path = save_reward_model(tmp_path / "rm", chat_template=None)
    padded = RewardModelScorer(path, micro_batch_size=3).score(PROMPTS, RESPONSES)
    packed = RewardModelScorer(path, micro_batch_size=3, remove_padding=True, max_row_tokens=8)
    assert packed.score(PROMPTS, RESPONSES) == pytest.approx(padded, abs=1e-5)
