"""The set of config keys is frozen: adding or renaming one is a deliberate edit of this test.

Every key here must work end to end (nothing in the schema is silently ignored).
"""

from posttrain.config.load import all_keys

EXPECTED_KEYS = """
model.path model.dtype model.use_remove_padding model.remove_padding_max_row_tokens
model.enable_gradient_checkpointing model.enable_activation_offload model.use_liger
model.lora_rank model.lora_alpha model.target_modules model.lora_dropout model.lora_merge model.lora_adapter_path
data.task data.train_files data.val_files data.prompt_key data.answer_key data.train_batch_size
data.val_batch_size data.max_prompt_length data.max_response_length data.overlong_prompts
data.num_train_examples data.num_val_examples data.max_operand data.task_options
rollout.n rollout.temperature rollout.top_p rollout.top_k rollout.chunk_size rollout.val_n rollout.val_greedy
rollout.max_num_seqs rollout.max_num_batched_tokens rollout.enable_chunked_prefill rollout.enforce_eager
rollout.name rollout.gpu_memory_utilization rollout.max_model_len rollout.tensor_model_parallel_size
rollout.free_cache_engine rollout.load_format rollout.layered_summon rollout.disable_log_stats
rollout.update_weights_bucket_megabytes
actor.ppo_mini_batch_size actor.ppo_micro_batch_size_per_gpu actor.ppo_epochs actor.shuffle
actor.use_dynamic_bsz actor.ppo_max_token_len_per_gpu actor.log_prob_micro_batch_size_per_gpu
actor.log_prob_max_token_len_per_gpu actor.ulysses_sequence_parallel_size actor.use_prefix_grouper
actor.policy_loss
actor.clip_ratio_low actor.clip_ratio_high actor.clip_ratio_c actor.loss_agg_mode actor.entropy_coeff
actor.use_kl_loss actor.kl_loss_coef actor.kl_loss_type
actor.entropy_from_logits_with_chunking actor.entropy_from_logits_chunk_size actor.entropy_checkpointing
actor.optim.lr actor.optim.weight_decay actor.optim.betas actor.optim.warmup_steps actor.optim.lr_schedule
actor.optim.min_lr_ratio actor.optim.grad_clip
ref.log_prob_micro_batch_size_per_gpu ref.log_prob_max_token_len_per_gpu ref.ulysses_sequence_parallel_size
ref.entropy_from_logits_with_chunking ref.entropy_from_logits_chunk_size ref.log_prob_use_dynamic_bsz ref.use_prefix_grouper
critic.model_path critic.ppo_mini_batch_size critic.ppo_micro_batch_size_per_gpu
critic.forward_micro_batch_size_per_gpu critic.ppo_epochs critic.use_dynamic_bsz critic.ppo_max_token_len_per_gpu
critic.forward_max_token_len_per_gpu critic.ulysses_sequence_parallel_size critic.cliprange_value
critic.loss_agg_mode critic.warmup_steps critic.shuffle critic.remove_padding_max_row_tokens
critic.use_remove_padding critic.enable_gradient_checkpointing critic.enable_activation_offload
critic.optim.lr critic.optim.weight_decay critic.optim.betas critic.optim.warmup_steps critic.optim.lr_schedule
critic.optim.min_lr_ratio critic.optim.grad_clip
distill.teacher.path distill.teacher.dtype distill.teacher.log_prob_micro_batch_size_per_gpu
distill.teacher.log_prob_max_token_len_per_gpu distill.teacher.log_prob_use_dynamic_bsz
distill.teacher.use_remove_padding distill.teacher.logprob_chunk_size distill.teacher.base_url distill.teacher.model
distill.teacher.api_key_env distill.teacher.timeout_s distill.teacher.max_retries distill.teacher.backoff_s
distill.teacher.max_concurrency distill.teacher.fsdp_config.fsdp_size distill.teacher.fsdp_config.param_offload
distill.teacher.fsdp_config.forward_prefetch distill.teacher.fsdp_config.reshard_after_forward
distill.teachers distill.opd_coef distill.top_k distill.gkd_coef distill.gkd_beta distill.gkd_temperature distill.gkd_top_k
distill.gkd_chunk_size
reward.function reward.timeout_s reward.failure_reward reward.fail_fast reward.rule_weight reward.score_during_generation
reward.model.enable reward.model.path reward.model.weight reward.model.normalize reward.model.micro_batch_size_per_gpu reward.model.use_dynamic_bsz
reward.model.forward_max_token_len_per_gpu reward.model.use_remove_padding reward.model.dtype reward.model.remove_padding_max_row_tokens
reward.judge.enable reward.judge.base_url reward.judge.model reward.judge.api_key_env reward.judge.rubric reward.judge.weight
reward.judge.unparsed_score reward.judge.max_concurrency reward.judge.timeout_s reward.judge.max_retries reward.judge.backoff_s
reward.judge.max_failures reward.judge.max_tokens reward.judge.temperature reward.judge.cache reward.judge.path
reward.judge.batch_size reward.judge.dtype reward.judge.mode reward.judge.pairwise_opponents
reward.prm.enable reward.prm.path reward.prm.separator reward.prm.separator_is_regex reward.prm.reduction
reward.prm.weight reward.prm.micro_batch_size_per_gpu reward.prm.dtype
algorithm.adv_estimator algorithm.gamma algorithm.lam algorithm.norm_adv_by_std_in_grpo
algorithm.use_kl_in_reward algorithm.kl_penalty
algorithm.kl_ctrl.type algorithm.kl_ctrl.kl_coef algorithm.kl_ctrl.target_kl algorithm.kl_ctrl.horizon
algorithm.rollout_correction.bypass_mode algorithm.rollout_correction.rollout_is
algorithm.rollout_correction.rollout_is_threshold algorithm.rollout_correction.rollout_rs
algorithm.rollout_correction.rollout_rs_threshold algorithm.rollout_correction.rollout_rs_threshold_lower
algorithm.rollout_correction.rollout_token_veto_threshold
trainer.total_steps trainer.test_freq trainer.save_freq trainer.max_ckpt_to_keep trainer.run_dir
trainer.resume trainer.seed trainer.device trainer.tune_malloc trainer.loggers trainer.export_hf trainer.export_merged
trainer.ray_ranks trainer.ray_cpus_per_rank trainer.ray_gpus_per_rank trainer.ray_resources_per_rank trainer.ray_placement
trainer.ray_max_restarts trainer.ray_address
trainer.collapse.truncated_jump trainer.collapse.truncated_min trainer.collapse.entropy_fraction
trainer.collapse.zero_reward_steps trainer.collapse.tool_rate_rise trainer.collapse.success_drop
sft.train_files sft.response_key sft.val_files sft.batch_size sft.micro_batch_size_per_gpu sft.epochs sft.max_steps sft.output_dir
actor.fsdp_config.fsdp_size actor.fsdp_config.param_offload actor.fsdp_config.optimizer_offload actor.fsdp_config.forward_prefetch actor.fsdp_config.reshard_after_forward ref.fsdp_config.fsdp_size ref.fsdp_config.param_offload ref.fsdp_config.forward_prefetch ref.fsdp_config.reshard_after_forward critic.fsdp_config.fsdp_size critic.fsdp_config.param_offload critic.fsdp_config.optimizer_offload critic.fsdp_config.forward_prefetch critic.fsdp_config.reshard_after_forward
trainer.dist_timeout_s
sft.optim.lr sft.optim.weight_decay sft.optim.betas sft.optim.warmup_steps sft.optim.lr_schedule
sft.optim.min_lr_ratio sft.optim.grad_clip
actor.optim.eps critic.optim.eps sft.optim.eps trainer.max_skipped_steps trainer.save_on_terminate
async_training.enable async_training.max_staleness
async_training.partial_rollout async_training.partial_rollout_tokens
async_training.rollout_num_cpus async_training.rollout_num_gpus async_training.rollout_resources
sandbox.backend sandbox.max_concurrent sandbox.time_limit_s sandbox.cpu_time_limit_s sandbox.memory_limit_mb
sandbox.max_processes sandbox.max_file_size_mb sandbox.max_disk_mb sandbox.max_output_bytes sandbox.bwrap_path sandbox.unsafe_no_isolation
sandbox.sandbox_fusion.url sandbox.sandbox_fusion.request_timeout_s sandbox.sandbox_fusion.max_retries
sandbox.sandbox_fusion.token_env
sandbox.code_reward.mode sandbox.code_reward.max_cases sandbox.code_reward.cases_per_run
async_training.rollout_worker
algorithm.filter_groups.enable algorithm.filter_groups.metric algorithm.filter_groups.max_num_gen_batches
algorithm.mask_truncated_samples reward.overlong_buffer.enable reward.overlong_buffer.len
reward.overlong_buffer.penalty_factor reward.overlong_buffer.log
rm.prompt_key rm.chosen_key rm.rejected_key rm.margin_key rm.max_length rm.batch_size rm.micro_batch_size_per_gpu
rm.use_dynamic_bsz rm.max_token_len_per_gpu
rm.epochs rm.max_steps rm.center_rewards_coefficient rm.output_dir rm.kind rm.step_separator
rm.optim.lr rm.optim.weight_decay rm.optim.betas rm.optim.warmup_steps rm.optim.lr_schedule
rm.optim.min_lr_ratio rm.optim.grad_clip rm.optim.eps
rollout.multi_turn.enable rollout.multi_turn.max_assistant_turns rollout.multi_turn.max_user_turns
rollout.multi_turn.max_tokens_per_turn rollout.multi_turn.max_parallel_calls rollout.multi_turn.tool_timeout_s
rollout.multi_turn.max_tool_response_length rollout.multi_turn.tool_response_truncate_side
rollout.multi_turn.tool_config_path rollout.multi_turn.render_tools rollout.multi_turn.format rollout.multi_turn.turn_rewards
rollout.multi_turn.env_timeout_s rollout.multi_turn.max_env_failures env.path env.kwargs
harness.path harness.command harness.timeout_s harness.max_failures harness.max_concurrent
harness.on_prefix_break harness.render_tools harness.host harness.port harness.max_request_bytes
""".split()


def test_config_keys_are_frozen():
    keys = all_keys()
    assert len(keys) == len(set(keys))
    added = sorted(set(keys) - set(EXPECTED_KEYS))
    removed = sorted(set(EXPECTED_KEYS) - set(keys))
    assert not added and not removed, f"config keys changed: added {added}, removed {removed}"
