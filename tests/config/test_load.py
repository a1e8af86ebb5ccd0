"""Config loading: defaults from the schema, YAML overrides, dotted overrides, clear errors."""

import dataclasses

import pytest

from posttrain.config.load import all_keys, build_config, diff_from_defaults, field_info, resolve_inherited
from posttrain.config.schema import PostTrainConfig


def test_defaults_come_from_schema():
    assert build_config() == resolve_inherited(PostTrainConfig())


def test_dotted_overrides_are_coerced():
    cfg = build_config(
        overrides=[
            "actor.ppo_mini_batch_size=16",
            "actor.optim.lr=3e-6",
            "actor.use_kl_loss=true",
            "trainer.loggers=jsonl,tensorboard",
            "actor.optim.betas=[0.9, 0.95]",
        ]
    )
    assert cfg.actor.ppo_mini_batch_size == 16
    assert cfg.actor.optim.lr == pytest.approx(3e-6)
    assert cfg.actor.use_kl_loss is True
    assert cfg.trainer.loggers == ["jsonl", "tensorboard"]
    assert cfg.actor.optim.betas == [0.9, 0.95]


def test_yaml_then_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("data:\n  train_batch_size: 8\nrollout:\n  n: 4\nactor:\n  ppo_mini_batch_size: 8\n")
    cfg = build_config([path], ["rollout.n=2"])
    assert cfg.data.train_batch_size == 8
    assert cfg.rollout.n == 2
    assert diff_from_defaults(cfg) == {
        "data.train_batch_size": 8,
        "rollout.n": 2,
        "actor.ppo_mini_batch_size": 8,
    }


def test_config_objects_are_not_shared():
    a = build_config(overrides=["trainer.loggers=jsonl"])
    b = build_config()
    assert b.trainer.loggers == ["console", "jsonl"]
    assert a.trainer.loggers == ["jsonl"]


@pytest.mark.parametrize(
    "override, fragments",
    [
        ("actor.ppo_mini_bach_size=4", ["actor.ppo_mini_bach_size", "actor.ppo_mini_batch_size"]),
        ("ppo_mini_batch_size=4", ["'ppo_mini_batch_size'", "actor.ppo_mini_batch_size"]),
        ("rollout.n=four", ["rollout.n", "integer", "four"]),
        ("actor.use_kl_loss=maybe", ["actor.use_kl_loss", "true or false"]),
        ("actor.optim.lr=fast", ["actor.optim.lr", "number"]),
        ("algorithm.adv_estimator=grp", ["algorithm.adv_estimator", "'grpo'"]),
        ("actor.ppo_epochs=0", ["actor.ppo_epochs", ">= 1"]),
        ("rollout.top_p=1.5", ["rollout.top_p", "<= 1"]),
        ("actor.ppo_mini_batch_size.x=1", ["actor.ppo_mini_batch_size", "not a section"]),
        ("noequals", ["key=value"]),
    ],
)
def test_bad_overrides_name_the_key(override, fragments):
    with pytest.raises(ValueError) as info:
        build_config(overrides=[override])
    for fragment in fragments:
        assert fragment in str(info.value)


def test_bad_yaml_is_reported_with_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("actor: [1, 2\n")
    with pytest.raises(ValueError, match="bad.yaml"):
        build_config([path])
    with pytest.raises(ValueError, match="does not exist"):
        build_config([tmp_path / "missing.yaml"])
    path.write_text("actor:\n  ppo_epoch: 2\n")
    with pytest.raises(ValueError, match="actor.ppo_epochs"):
        build_config([path])


def test_every_field_documents_itself():
    for key in all_keys():
        field, _ = field_info(key)
        assert field.metadata.get("help"), f"{key} has no help text"


def test_sections_have_docstrings():
    for f in dataclasses.fields(PostTrainConfig):
        assert f.metadata.get("help"), f.name


def test_config_reference_doc_is_current():
    from pathlib import Path

    from posttrain.config.reference import render_config_reference

    doc = Path(__file__).resolve().parents[2] / "docs" / "config.md"
    assert doc.read_text() == render_config_reference(), (
        "docs/config.md is stale: run `python -m posttrain.config.reference > docs/config.md`"
    )


def test_inherited_keys_follow_their_source_unless_set():
    """A role's section holds every key it reads; a few default to another section's value (null), resolved
    once when the config is built."""
    cfg = build_config(overrides=["actor.use_dynamic_bsz=true", "model.dtype=bf16", "actor.shuffle=false"])
    assert cfg.ref.log_prob_use_dynamic_bsz is True
    assert cfg.reward.model.dtype == "bf16"
    assert cfg.critic.shuffle is False
    assert cfg.critic.remove_padding_max_row_tokens == cfg.model.remove_padding_max_row_tokens
    own = build_config(overrides=["actor.use_dynamic_bsz=true", "ref.log_prob_use_dynamic_bsz=false"])
    assert own.ref.log_prob_use_dynamic_bsz is False
    assert build_config(overrides=["actor.use_prefix_grouper=false"]).ref.use_prefix_grouper is False


@pytest.mark.parametrize(
    "overrides,expected",
    [
        ([], True),  # the built-in job: rollout.n = 8
        (["rollout.n=1"], False),  # nothing to share
        (["model.use_remove_padding=true"], False),  # packed rows (flash-attention's varlen kernel on GPUs)
        (["actor.ulysses_sequence_parallel_size=2"], False),  # the attention works on whole sequences
        (["actor.use_prefix_grouper=false"], False),  # verl's layout
        (["rollout.n=1", "actor.use_prefix_grouper=true"], True),  # as set
    ],
)
def test_prefix_grouper_is_on_by_default_where_it_is_exact_and_saves_work(overrides, expected):
    cfg = build_config(overrides=overrides)
    assert cfg.actor.use_prefix_grouper is expected
    assert cfg.ref.use_prefix_grouper is expected
