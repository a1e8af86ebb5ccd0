"""verl's multi-turn GSM8K example loads as verl ships it: the run config (Hydra's header ignored in one line,
the SGLang rollout on an engine posttrain has, verl's qwen format as hermes) and its tool configs (verl's tool
classes served by posttrain's own GSM8K check and code tool; a class_name found beside the config).

The files are written here from their public text in volcengine/verl: at commit
b178a3cd56f58b2d502255daba591e92833930a7 (examples/sglang_multiturn/config/gsm8k_multiturn_grpo.yaml,
tool_config/gsm8k_tool_config.yaml, tool_config/sandbox_fusion_tool_config.yaml), and the run config at
d843f95992b93154d0c2eb1ecd157e63e6d7d5d1, its last version with `format: qwen` and `max_turns`. (``\\x20``: the
trailing space verl's files have after ``config:``.)
"""

import asyncio
import logging

from posttrain.agents.build import environment_factory
from posttrain.agents.gsm8k_tool import bind_row
from posttrain.agents.tool_config import load_tool_config
from posttrain.config.load import build_config

GRPO_B178A3C = """\
hydra:
  searchpath:
    - file://verl/trainer/config

defaults:
  - ppo_trainer
  - _self_

data:
  max_prompt_length: 1024
  max_response_length: 1024
  train_batch_size: 256
  return_raw_chat: True

actor_rollout_ref:
  hybrid_engine: True
  rollout:
    name: sglang
    multi_turn:
      enable: True
      max_assistant_turns: 5
"""

GRPO_D843F95 = """\
hydra:
  searchpath:
    - file://verl/trainer/config

defaults:
  - ppo_trainer
  - _self_

data:
  max_prompt_length: 1024
  max_response_length: 1024
  train_batch_size: 256
  return_raw_chat: True

actor_rollout_ref:
  hybrid_engine: True
  rollout:
    name: sglang
    multi_turn:
      enable: True
      max_turns: 5
      format: qwen
      # tool_config_path: "./config/tool_config/gsm8k_tool_config.yaml"
"""

GSM8K_TOOLS = """\
tools:
  - class_name: "verl.tools.gsm8k_tool.Gsm8kTool"
    config:\x20
      type: native
    tool_schema:
      type: "function"
      function:
        name: "calc_gsm8k_reward"
        description: "A tool for calculating the reward of gsm8k. (1.0 if parsed answer is correct, 0.0 if parsed answer is incorrect or not correctly parsed)"
        parameters:
          type: "object"
          properties:
            answer:
              type: "string"
              description: "The model's answer to the GSM8K math problem, must be a digits"
          required: ["answer"]
"""

SANDBOX_FUSION_TOOLS = """\
tools:
  - class_name: "verl.tools.sandbox_fusion_tools.SandboxFusionTool"
    config:\x20
      sandbox_fusion_url: "https://xxx.apigateway-cn-beijing.volceapi.com/run_code"
      num_workers: 10
      enable_global_rate_limit: true
      rate_limit: 10
      default_timeout: 30
      default_language: "python"
      memory_limit_mb: 1024
      type: native

    tool_schema:
      type: "function"
      function:
        name: "code_interpreter"
        description: "A tool for executing code."
        parameters:
          type: "object"
          properties:
            code:
              type: "string"
              description: "The code to execute."
          required: ["code"]"""


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_the_multi_turn_run_config_loads_as_verl_ships_it(tmp_path, caplog):
    for name, text in (("b178a3c.yaml", GRPO_B178A3C), ("d843f95.yaml", GRPO_D843F95)):
        (tmp_path / name).write_text(text)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="posttrain"):
            cfg = build_config([str(tmp_path / name)])
        said = _warnings(caplog)
        hydra = [line for line in said if "hydra" in line or "defaults" in line]
        assert len(hydra) == 1 and "hydra.searchpath, defaults are ignored" in hydra[0], said
        assert cfg.rollout.name in ("native", "vllm")
        assert any(f"rollout.name={cfg.rollout.name}" in line and "no SGLang engine" in line for line in said)
        mt = cfg.rollout.multi_turn
        assert mt.enable and mt.max_assistant_turns == 5 and mt.format == "hermes"
        assert (cfg.data.max_prompt_length, cfg.data.train_batch_size) == (1024, 256)


def test_verls_gsm8k_tool_is_posttrains_answer_check(tmp_path):
    path = tmp_path / "gsm8k_tool_config.yaml"
    path.write_text(GSM8K_TOOLS)
    tools = load_tool_config(path)
    assert list(tools.tools) == ["calc_gsm8k_reward"]
    assert tools["calc_gsm8k_reward"].schema["function"]["description"].startswith("A tool for calculating")
    check = bind_row(tools, {"ground_truth": "72"})["calc_gsm8k_reward"].fn
    assert check("72").endswith("reward 1.0") and check("#### 1,200").endswith("reward 0.0")
    # verl's older module path names the same tool
    path.write_text(GSM8K_TOOLS.replace("verl.tools.gsm8k_tool", "verl.workers.tool.gsm8k_tool"))
    assert list(load_tool_config(path).tools) == ["calc_gsm8k_reward"]


def test_the_gsm8k_tool_answers_in_a_trajectory_from_its_row(tmp_path):
    path = tmp_path / "gsm8k_tool_config.yaml"
    path.write_text(GSM8K_TOOLS)
    cfg = build_config(overrides=[f"rollout.multi_turn.tool_config_path={path}"])
    make_env = environment_factory(cfg)
    call = '<tool_call>{"name": "calc_gsm8k_reward", "arguments": {"answer": "18"}}</tool_call>'
    right = asyncio.run(make_env({"ground_truth": "18"}).step(call))
    wrong = asyncio.run(make_env({"ground_truth": "17"}).step(call))
    assert "reward 1.0" in right.messages[0]["content"] and "reward 0.0" in wrong.messages[0]["content"]


def test_verls_sandbox_fusion_tool_runs_in_the_runs_sandbox(tmp_path, caplog, sandbox):
    path = tmp_path / "sandbox_fusion_tool_config.yaml"
    path.write_text(SANDBOX_FUSION_TOOLS)
    with caplog.at_level(logging.WARNING, logger="posttrain"):
        tools = load_tool_config(path)
    said = _warnings(caplog)
    assert len(said) == 1 and "sandbox_fusion_url" in said[0] and "sandbox.sandbox_fusion.url" in said[0]
    tool = tools["code_interpreter"]
    assert tool.timeout_s == 30
    cfg = build_config(overrides=[f"rollout.multi_turn.tool_config_path={path}"])
    env = environment_factory(cfg)({})
    call = '<tool_call>{"name": "code_interpreter", "arguments": {"code": "print(6 * 7)"}}</tool_call>'
    assert asyncio.run(env.step(call)).messages[0]["content"].strip() == "42"


def test_a_class_name_is_found_beside_the_config(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path.parent)  # not the config's directory
    (tmp_path / "mytools").mkdir()
    (tmp_path / "mytools" / "lookup.py").write_text(
        'def find(word: str) -> str:\n    """Look a word up.\n\n    Args:\n        word: the word.\n    """\n'
        "    return word.upper()\n"
    )
    path = tmp_path / "tools.yaml"
    path.write_text('tools:\n  - class_name: "mytools.lookup.find"\n')
    assert load_tool_config(path)["find"].fn("abc") == "ABC"
