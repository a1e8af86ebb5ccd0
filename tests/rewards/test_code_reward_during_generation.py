"""The code reward scored while the step generates (reward.score_during_generation=always; auto does so where the rollout runs on a GPU) gives the
step that scoring afterwards gives: rewards, every reward/code/* count, the other metrics and the weights."""

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from posttrain.rl.train_command import run_training
from tests.helpers import read_metrics, small_config, untimed

DATA = Path(__file__).parents[2] / "examples/code/tiny_code.jsonl"


def test_the_code_reward_during_generation_gives_the_same_step(sandbox, tiny_model_dir, tmp_path):
    common = [f"data.train_files=[{DATA}]", "data.answer_key=answer", "reward.function=code"]
    common += ["sandbox.time_limit_s=5", "trainer.total_steps=1", "data.max_prompt_length=256"]
    common += ["reward.timeout_s=30", "rollout.max_num_seqs=4", "rollout.max_num_batched_tokens=256"]
    steps, weights = {}, {}
    for when in ("never", "always"):
        run = tmp_path / when
        run_training(
            small_config(tiny_model_dir, run, *common, f"reward.score_during_generation={when}"), quiet=True
        )
        (steps[when],) = read_metrics(run)
        weights[when] = AutoModelForCausalLM.from_pretrained(run / "final_model").state_dict()
    assert untimed(steps["always"]) == untimed(steps["never"])
    assert steps["always"]["reward/code/samples"] + steps["always"]["reward/code/no_code"] == 16
    for name, tensor in weights["never"].items():
        assert torch.equal(weights["always"][name], tensor), name
