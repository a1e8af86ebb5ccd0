"""The built-in `python_arithmetic` task: large products solved by printing them with the python tool, played in
the `python` environment with the real bwrap sandbox; a GRPO run on it goes end to end."""

from posttrain.agents.build import environment_factory
from posttrain.agents.demos import demonstrations
from posttrain.agents.driver import Generation, run_trajectories
from posttrain.agents.hermes import tool_call_text
from posttrain.config.load import build_config
from posttrain.data.tasks import load_task
from posttrain.data.tasks.arithmetic import arithmetic_reward
from posttrain.data.tasks.python_arithmetic import demonstration
from posttrain.models.tiny import build_tiny_tokenizer
from posttrain.rl.train_command import run_training
from tests.helpers import multi_turn_settings, read_metrics, small_config


def test_splits_are_disjoint_seeded_and_large():
    train, val = load_task("python_arithmetic", 3, n_train=50, n_val=10)
    again, _ = load_task("python_arithmetic", 3, n_train=50, n_val=10)
    assert [r.prompt for r in train] == [r.prompt for r in again]
    assert not {r.prompt for r in train} & {r.prompt for r in val}
    for r in train + val:
        a, b = r.extra["a"], r.extra["b"]
        assert 10**5 <= a < 10**9 and 10**5 <= b < 10**9 and r.ground_truth == str(a * b)


def test_the_task_plays_in_the_python_environment_and_rewards_the_printed_product(sandbox):
    cfg = build_config(overrides=["data.task=python_arithmetic", "sandbox.time_limit_s=5"])
    assert cfg.rollout.multi_turn.enable and cfg.env.path == "python"
    tok = build_tiny_tokenizer()
    (record,), _ = load_task("python_arithmetic", 0, n_train=1, n_val=0)
    a, b = record.extra["a"], record.extra["b"]

    def use_the_tool(requests):
        out = []
        for r in requests:
            seen = tok.decode(r.ids)
            if "<tool_response>" in seen:
                text = seen.rsplit("<tool_response>", 1)[1].split("</tool_response>")[0].strip()
            else:
                text = tool_call_text("python", {"code": f"print({a} * {b})"})
            reply = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            out.append(Generation(reply, [0.0] * len(reply), "stop"))
        return out

    settings = multi_turn_settings(max_response_length=2000)
    traj = run_trajectories(
        [{"prompt": record.prompt}], environment_factory(cfg), use_the_tool, tok, settings
    )[0]
    answer = traj.messages[-1]["content"]
    assert [m["role"] for m in traj.messages] == [m["role"] for m in demonstration(a, b)]
    assert traj.messages[2]["content"] == answer == str(a * b) == demonstration(a, b)[-1]["content"]
    assert arithmetic_reward(record.prompt, answer, record.ground_truth, {}) == 1.0
    assert arithmetic_reward(record.prompt, str(a * b + 1), record.ground_truth, {}) == 0.0


def test_grpo_on_python_arithmetic_runs(sandbox, tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    overrides = ["data.task=python_arithmetic", "reward.function=", "data.max_response_length=24"]
    overrides += ["rollout.multi_turn.max_tokens_per_turn=8", "sandbox.time_limit_s=5"]
    run_training(small_config(tiny_model_dir, run, *overrides), quiet=True)
    metrics = read_metrics(run)
    assert [m["step"] for m in metrics] == [1, 2]
    assert all("tools/call_frequency" in m and "actor/pg_loss" in m for m in metrics)


def test_the_demonstration_call_is_the_hermes_block():
    assert demonstration(12, 34)[1]["content"] == tool_call_text("python", {"code": "print(12 * 34)"})


def test_demonstrations_call_the_tool_or_answer_wrong_from_memory():
    """The warm start's data (make_demos.py python_arithmetic): the task's solved conversation, or, in about half
    of them, a wrong number without the tool, so GRPO has something to learn."""
    train, _ = load_task("python_arithmetic", 1, n_train=200, n_val=0, min_digits=2, max_digits=2)
    rows = demonstrations("python_arithmetic", train, 200, seed=1)
    with_tool = [(r, row) for r, row in zip(train, rows) if len(row["messages"]) == 4]
    assert 70 <= len(with_tool) <= 130
    for record, row in with_tool:
        assert row["messages"] == demonstration(record.extra["a"], record.extra["b"])
    for record, row in zip(train, rows):
        if len(row["messages"]) == 2:
            assert row["messages"][1]["content"] != record.ground_truth
    assert all(
        len(row["messages"]) == 4 for row in demonstrations("python_arithmetic", train, 20, 1, rate=0.0)
    )
