"""For every schema field, the evidence that a plan which sets it runs as it reads.

Each field is acted on by the runtime for the plan's backends (Runs: behaviour tests that would fail if the
field were ignored), or refused by a plan rule when set to a value the runtime cannot honour (Refused), or
both: a field the runtime acts on for one backend is refused for another. test_field_coverage.py fails on a
schema field missing here, a test id that does not exist, and a refusal that does not happen.
"""

from __future__ import annotations

from tests.coverage.evidence import Evidence, Refused, Runs

TINY = ("+recipe=tiny_lora_agentic",)  # session v1, in_place, colocated, one adapter
TINY_MULTI = ("+recipe=tiny_multi_lora",)  # three adapters, disaggregated
GPU = ("cluster=gpu_1x", "engine=sglang")  # one 80 GB GPU, FSDP trainer, a real SGLang engine
GPU_DISAGG = ("cluster=h100_1x8", "engine=sglang", "topology=disaggregated", "topology.actor_num_gpus_per_node=4")
MEGATRON_CPU = ("trainer=megatron", "lora_mode=raw")  # the Megatron trainer, raw LoRA, on the default CPU shape
QWEN05 = ("+recipe=qwen25_05b_lora",)  # the Megatron trainer with Megatron-Bridge LoRA on one GPU

ASYNC = (
    "topology=disaggregated",
    "topology.actor_num_gpus_per_node=1",
    "rollout.schedule=async",
    "rollout.max_weight_staleness=1",
    "algorithm.use_tis=true",
)  # 1 trainer + 1 engine device, async
OFFLOAD = "tests/loops/test_step_offload.py"
TRAINER_OFFLOAD = "test_the_megatron_trainer_leaves_after_training_and_before_the_engines_take_their_weights_back"
DRIVER = "tests/loops/test_driver.py"
SGLANG_ARGS = "tests/sglang_client/test_sglang_launch_args.py"
GPU_ENGINE = (f"{SGLANG_ARGS}::test_each_gpu_engine_setting_reaches_the_sglang_command_line",)
FSDP = "tests/trainer/test_fsdp.py"
OPTIONS = "tests/trainer/test_trainer_options.py"
WEIGHT_SYNC = "tests/loops/test_weight_sync.py"
LOSS = "tests/trainer/test_loss.py"
DERIVED = "tests/plan/test_derived.py"
FROM_PLAN = "tests/trainer/megatron/test_from_plan.py::test_trainer_backend_picks_the_trainer_the_plan_runs"
MULTI_CONFIG = "tests/multi_lora/test_config.py"

FIELDS: dict[str, tuple[Evidence, ...]] = {
    # ---- run ----
    "run.name": (Runs(("tests/cli/test_miles_run.py::test_plan_flag_writes_plan_config_and_provenance",)),),
    "run.seed": (
        Runs(
            (
                "tests/trainer/test_plan_settings.py::test_run_seed_sets_the_adapters_initialisation",
                "tests/rollout/test_context.py::test_run_seed_picks_the_prompt_stream",
                "tests/executors/test_plan_engines.py::test_the_engine_seeds_its_sampling_with_run_seed",
            )
        ),
    ),
    "run.output_root": (Runs(("tests/cli/test_hydra_settings.py::test_a_sweep_puts_its_jobs_under_run_output_root",)),),
    "run.resume": (Runs((f"{DRIVER}::test_sigkill_mid_run_resumes_with_no_step_lost_or_repeated",)),),
    "run.dir": (Runs((f"{DRIVER}::test_sigkill_mid_run_resumes_with_no_step_lost_or_repeated",)),),
    # ---- cluster: what the job may use ----
    "cluster.nodes": (
        Runs(
            (
                "tests/executors/test_multi_node_ray.py::test_the_glm52_shaped_plan_runs_on_two_nodes_with_the_same_result_as_on_one",
            )
        ),
        Refused("local-executor-is-one-node", "2"),
    ),
    "cluster.gpus_per_node": (Refused("gpu-cluster-needs-gpus", "0", ("cluster=gpu_1x",)),),
    "cluster.gpu_type": (Refused("cpu-cluster-runs-no-gpu-components", "H100"),),
    "cluster.gpu_memory_gb": (
        Refused("cpu-cluster-runs-no-gpu-components", "80"),
        Refused("engine-model-fits-memory", "1", ("cluster=gpu_1x", "engine=sglang", "model=qwen3_4b")),
    ),
    "cluster.cpu_only": (Refused("gpu-cluster-needs-gpus", "false"),),
    "cluster.cpu_devices_per_node": (
        Runs(("tests/multi_lora_e2e/test_trainer_ranks.py::test_a_multi_lora_run_trains_on_two_trainer_ranks",)),
        Refused("sizes-positive", "0"),
    ),
    "cluster.memory_gb_per_node": (Refused("host-memory-holds-cpu-plan", "0.001"),),
    # ---- topology ----
    "topology.kind": (Runs((f"{DRIVER}::test_async_schedule_overlaps_generation_and_trains_one_version_stale",)),),
    "topology.actor_num_nodes": (Refused("trainer-fits-cluster", "2"),),
    "topology.actor_num_gpus_per_node": (
        Runs((f"{DRIVER}::test_a_run_on_two_trainer_ranks_trains_and_saves_its_adapter",)),
    ),
    "topology.rollout_num_gpus": (
        Runs(("tests/executors/test_plan_engines.py::test_a_disaggregated_plan_starts_one_engine_per_rollout_gpu",)),
    ),
    "topology.offload_train": (
        Runs((f"{OFFLOAD}::{TRAINER_OFFLOAD}",)),
        Refused("offload-needs-megatron", "true", GPU),
    ),
    "topology.offload_rollout": (
        Runs((f"{OFFLOAD}::test_each_step_offloads_and_onloads_in_the_order_of_the_colocated_loop",)),
        Refused("rollout-offload-needs-sync-schedule", "true", ASYNC),
        Refused("multi-lora-rollout-offload-not-built", "true", TINY_MULTI),
        Refused("rollout-offload-engine-restarts-not-built", "true", ("executor.engine_restarts=1",)),
    ),
    "topology.offload_rollout_level": (
        Runs(("tests/plan/test_offload_plan.py::test_a_level_without_the_weights_keeps_them_resident",)),
    ),
    # ---- model: a description of the checkpoint, checked against it ----
    "model.name": (
        Runs(("tests/executors/test_plan_engines.py::test_the_engine_serves_the_base_model_under_model_name",)),
        Refused("served-model-name-has-no-colon", "org:tiny"),
    ),
    "model.path": (Runs((f"{DRIVER}::test_final_adapter_is_served_by_the_engine_from_lora_paths",)),),
    "model.family": (
        Refused("model-matches-checkpoint", "qwen2"),
        Refused("raw-lora-needs-converter", "llama", (*QWEN05, "lora_mode=raw")),
        Refused("bridge-supports-model", "phi3", QWEN05),
    ),
    "model.num_layers": (Refused("model-matches-checkpoint", "4"),),
    "model.hidden_size": (Refused("model-matches-checkpoint", "128"),),
    "model.num_attention_heads": (
        Refused("model-matches-checkpoint", "8"),
        Refused("tensor-parallel-divides-heads", "3", (*MEGATRON_CPU, "trainer.parallel.tp=2")),
    ),
    "model.vocab_size": (Refused("model-matches-checkpoint", "1000"),),
    "model.num_experts": (Refused("model-matches-checkpoint", "4"),),
    "model.moe_topk": (Refused("model-matches-checkpoint", "4"),),
    "model.params_b": (Refused("embedded-engine-model-too-large", "2.0"),),
    "model.kv_lora_rank": (Refused("model-matches-checkpoint", "16"),),
    "model.q_lora_rank": (Refused("model-matches-checkpoint", "16"),),
    "model.has_dsa_indexer": (Refused("model-matches-checkpoint", "true"),),
    "model.native_lora": (
        Refused("megatron-lora-layouts-need-megatron", "true"),
        Refused("native-lora-model-not-supported", "true", MEGATRON_CPU),
    ),
    "model.max_context_len": (
        Refused("model-matches-checkpoint", "4096"),
        Runs(
            (
                "tests/executors/test_plan_engines.py::test_the_engine_serves_with_the_plans_context_length",
                "tests/executors/test_plan_engines.py::test_a_request_beyond_the_context_length_is_refused_with_400",
            )
        ),
    ),
    # ---- trainer ----
    "trainer.backend": (Runs((FROM_PLAN,)), Refused("lora-mode-matches-trainer", "megatron")),
    "trainer.parallel.tp": (
        Refused("fsdp-has-no-model-parallelism", "2"),
        Refused("tensor-parallel-divides-heads", "3", MEGATRON_CPU),
    ),
    "trainer.parallel.pp": (
        Refused("fsdp-has-no-model-parallelism", "2"),
        Refused("megatron-parallelism-not-built", "2", MEGATRON_CPU),
    ),
    "trainer.parallel.cp": (
        Refused("fsdp-has-no-model-parallelism", "2"),
        Refused("megatron-parallelism-not-built", "2", MEGATRON_CPU),
    ),
    "trainer.parallel.ep": (
        Refused("fsdp-has-no-model-parallelism", "2"),
        Refused(
            "bridge-expert-lora-needs-ep1",
            "2",
            (*MEGATRON_CPU, "lora_mode=bridge", "adapters.target_modules=[all-linear]"),
        ),
    ),
    "trainer.parallel.etp": (
        Refused("fsdp-has-no-model-parallelism", "2"),
        Refused("megatron-parallelism-not-built", "2", MEGATRON_CPU),
    ),
    "trainer.parallel.micro_batch_size": (Runs((f"{FSDP}::test_micro_batching_does_not_change_the_update",)),),
    "trainer.parallel.qkv_format": (Runs((FROM_PLAN,)), Refused("fsdp-pads-rows", "thd")),
    "trainer.parallel.recompute": (
        Runs((f"{OPTIONS}::test_recompute_replays_each_layer_in_backward_and_leaves_the_update_unchanged",)),
    ),
    "trainer.offload_target": (
        Runs(
            (
                f"{OFFLOAD}::{TRAINER_OFFLOAD}",
                "tests/trainer/megatron/test_train_offload.py::test_cpu_offload_on_a_cpu_host_moves_nothing",
            )
        ),
        Refused("disk-offload-needs-megatron", "disk"),
    ),
    "trainer.python": (
        Runs(("tests/trainer/test_trainer_host.py::test_a_hosted_trainer_trains_as_the_same_trainer_in_the_driver",)),
        Refused("trainer-python-runs-bridge", "/no/such/python", MEGATRON_CPU),
    ),
    "trainer.offload_disk_dir": (Runs((f"{OFFLOAD}::{TRAINER_OFFLOAD}",)),),
    "trainer.offload_disk_chunk_mb": (
        Runs((f"{OFFLOAD}::{TRAINER_OFFLOAD}",)),
        Refused(
            "disk-offload-needs-megatron",
            "0",
            (*MEGATRON_CPU, "topology.offload_train=true", "trainer.offload_target=disk"),
        ),
    ),
    "trainer.calculate_per_token_loss": (
        Runs((f"{OPTIONS}::test_per_token_loss_weighs_each_sample_by_its_trained_tokens",)),
    ),
    "trainer.use_dynamic_batch_size": (
        Runs((f"{OPTIONS}::test_a_token_budget_packs_micro_batches_and_leaves_the_update_unchanged",)),
    ),
    "trainer.max_tokens_per_gpu": (
        Runs((f"{OPTIONS}::test_a_token_budget_packs_micro_batches_and_leaves_the_update_unchanged",)),
        Refused("dynamic-batch-token-budget", "1000"),
    ),
    "trainer.stream_optimizer_state_to_disk": (Refused("streamed-optimizer-state-rejects-lora", "true"),),
    "trainer.rematerialize_param_from_master_weight": (Refused("rematerialize-rejects-lora", "true"),),
    "trainer.keep_old_actor": (Refused("keep-old-actor-not-built", "true"),),
    # ---- LoRA and adapters ----
    "trainer.lora_mode": (Refused("lora-mode-matches-trainer", "bridge"), Refused("lora-mode-matches-trainer", "raw")),
    "adapters.kind": (
        Refused("full-weight-training-not-built", "none", ("lora_mode=none",)),
        Runs(
            (
                "tests/multi_lora_e2e/test_lifecycle.py::test_the_new_tenant_trains_and_the_others_carry_on_to_their_num_step",
                f"{DRIVER}::test_run_logs_one_metrics_record_per_step_with_weight_versions",
            )
        ),
    ),
    "adapters.rank": (Runs((f"{FSDP}::test_adapter_config_matches_the_plan",)),),
    "adapters.alpha": (Runs((f"{FSDP}::test_adapter_config_matches_the_plan",)),),
    "adapters.dropout": (
        Runs(
            (
                "tests/trainer/test_plan_settings.py::test_adapters_dropout_is_the_lora_dropout_of_the_trained_and_exported_adapter",
            )
        ),
    ),
    "adapters.lora_type": (
        Refused("megatron-lora-layouts-need-megatron", "canonical_lora"),
        Refused("megatron-lora-layout-not-built", "canonical_lora", MEGATRON_CPU),
    ),
    "adapters.target_modules": (
        Runs((f"{FSDP}::test_adapter_config_matches_the_plan",)),
        Refused("megatron-lora-fused-targets", "[q_proj]", MEGATRON_CPU),
    ),
    "adapters.exclude_modules": (Runs((f"{DERIVED}::test_exclude_modules_removes_expanded_names",)),),
    "adapters.train_only": (Refused("train-only-adapter-not-built", "true"),),
    "adapters.base_cpu_backup": (
        Runs(
            (
                "tests/embedded_engine/test_memory_occupation.py::"
                "test_with_a_cpu_backup_the_weights_stay_in_host_memory_and_come_back_from_it",
                "tests/plan/test_offload_plan.py::test_the_cpu_summary_says_what_offload_frees_there",
            )
        ),
        Refused("embedded-engine-takes-no-sglang-gpu-settings", "true"),
        Refused("cpu-backup-needs-colocated-lora-rollout", "true", GPU_DISAGG),
    ),
    "adapters.experts_shared_outer": (
        Refused("megatron-lora-layouts-need-megatron", "true"),
        Refused("megatron-lora-layout-not-built", "true", MEGATRON_CPU),
    ),
    "adapters.path": (
        Runs(
            (
                f"{FSDP}::test_a_trainer_starts_from_the_saved_adapter_of_adapters_path",
                f"{DRIVER}::test_final_adapter_is_served_by_the_engine_from_lora_paths",
                "tests/plan/test_starting_adapter.py::test_a_fitting_adapter_starts_the_trainer_and_the_engines",
            )
        ),
        Refused("starting-adapter-fits-plan", "/no/such/adapter"),
    ),
    "adapters.runs": (Runs(("tests/multi_lora/test_config.py::test_a_plan_adapter_registers_with_its_own_values",)),),
    "adapters.max_slots": (
        Runs(("tests/multi_lora/test_service.py::test_plan_settings_take_the_engines_lora_flags_and_the_plan_sizes",)),
    ),
    "adapters.api_port": (
        Runs(
            (
                "tests/multi_lora_e2e/test_ray_controller.py::test_the_controller_serves_under_its_named_actor_on_the_head_node_and_stops_with_it",
            )
        ),
    ),
    "adapters.idle_poll_s": (
        Runs(
            (
                "tests/multi_lora/test_loop_waits.py::test_service_mode_waits_for_an_adapter_and_polls_every_idle_poll_s",
                "tests/multi_lora/test_loop_waits.py::test_service_mode_sees_a_new_adapter_only_at_its_next_poll",
            )
        ),
    ),
    "adapters.service_mode": (
        Runs(
            (
                "tests/multi_lora/test_loop_waits.py::test_a_bounded_run_ends_when_no_adapter_is_left",
                "tests/multi_lora/test_loop_waits.py::test_service_mode_waits_for_an_adapter_and_polls_every_idle_poll_s",
            )
        ),
    ),
    "adapters.max_coalesce_wait_s": (
        Runs(
            (
                "tests/multi_lora/test_loop_waits.py::test_a_partial_batch_ships_once_no_group_arrived_for_max_coalesce_wait_s",
                "tests/multi_lora/test_loop_waits.py::test_a_long_coalesce_wait_holds_the_batch_until_the_adapters_step_is_complete",
            )
        ),
    ),
    "adapters.max_empty_wait_s": (
        Runs(
            (
                "tests/multi_lora/test_loop_waits.py::test_an_empty_collect_gives_up_after_max_empty_wait_s",
                "tests/multi_lora/test_loop_waits.py::test_an_empty_collect_waits_for_max_empty_wait_s",
            )
        ),
    ),
    # ---- engine ----
    "engine.build": (
        Runs(
            (
                "tests/sglang_client/test_sglang_pin.py::test_the_embedded_engine_is_launched_as_the_plans_build",
                "tests/sglang_client/test_embedded_protocol.py::test_served_as_stock_the_fork_route_is_a_404_and_the_prefix_field_is_dropped",
            )
        ),
        Refused("stock-sglang-has-no-lora-broadcast", "stock", TINY_MULTI),
    ),
    "engine.kind": (
        Runs(
            (
                "tests/executors/test_plan_engines.py::test_engine_kind_selects_the_module_the_executor_starts",
                "tests/executors/test_plan_engines.py::test_the_engine_serves_the_base_model_under_model_name",
            )
        ),
    ),
    "engine.tp_size": (
        Refused("embedded-engine-is-one-process", "2"),
        Runs((f"{SGLANG_ARGS}::test_engine_parallelism_reaches_the_command_line",)),
    ),
    "engine.ep_size": (
        Refused("embedded-engine-is-one-process", "2"),
        Runs((f"{SGLANG_ARGS}::test_engine_parallelism_reaches_the_command_line",)),
    ),
    "engine.dp_attention": (Refused("embedded-engine-takes-no-sglang-gpu-settings", "true"), Runs(GPU_ENGINE)),
    "engine.base_port": (
        Runs(
            (
                "tests/executors/test_ray_executor.py::test_ray_executor_serves_the_plan_restarts_a_dead_engine_and_stops_every_process",
            )
        ),
    ),
    "engine.dist_init_port": (
        Runs(
            (
                "tests/executors/test_multi_node_engine.py::test_each_node_agent_starts_its_rank_of_an_engine_wider_than_a_node_and_a_dead_rank_names_it",
            )
        ),
    ),
    "engine.mem_fraction_static": (Refused("embedded-engine-takes-no-sglang-gpu-settings", "0.5"), Runs(GPU_ENGINE)),
    "engine.lora_backend": (Refused("embedded-engine-takes-no-sglang-gpu-settings", "csgmv"), Runs(GPU_ENGINE)),
    "engine.max_lora_rank": (Runs((f"{DERIVED}::test_explicit_engine_max_lora_rank_is_kept",)),),
    "engine.enable_cuda_graph": (Refused("embedded-engine-takes-no-sglang-gpu-settings", "false"), Runs(GPU_ENGINE)),
    "engine.fp8_rollout": (Refused("embedded-engine-takes-no-sglang-gpu-settings", "true"), Runs(GPU_ENGINE)),
    "engine.extra_args": (Refused("embedded-engine-takes-no-sglang-gpu-settings", "[--foo]"), Runs(GPU_ENGINE)),
    "engine.embedded_max_params_b": (Refused("embedded-engine-model-too-large", "0.00001"),),
    "engine.startup_timeout_s": (
        Runs(
            (
                "tests/executors/test_plan_engines.py::test_an_engine_not_healthy_within_engine_startup_timeout_s_fails_the_start_naming_it",
            )
        ),
    ),
    "engine.max_n": (
        Runs(("tests/embedded_engine/test_limits.py::test_the_plans_engine_limits_reach_the_engine",)),
        Refused("rollout-within-engine-limits", "2", ("rollout.n_samples_per_prompt=4",)),
        Refused("sglang-engine-has-no-request-limits", "8", GPU),
    ),
    "engine.max_batch_size": (
        Runs(("tests/embedded_engine/test_limits.py::test_the_plans_engine_limits_reach_the_engine",)),
        Refused("rollout-within-engine-limits", "2", ("rollout.n_samples_per_prompt=4",)),
        Refused("sglang-engine-has-no-request-limits", "8", GPU),
    ),
    # ---- router ----
    "router.kind": (
        Runs(("tests/executors/test_local_executor.py::test_engines_and_router_start_healthy_and_all_stop",)),
    ),
    "router.policy": (
        Runs(("tests/sglang_client/test_router.py::test_routing_key_keeps_each_session_on_one_engine",)),
    ),
    "router.port": (
        Runs(("tests/executors/test_local_executor.py::test_engines_and_router_start_healthy_and_all_stop",)),
    ),
    "router.metrics_port": (
        Runs(("tests/sglang_client/test_router.py::test_router_argv_binds_metrics_to_the_router_host",)),
    ),
    # ---- session server ----
    "session.version": (
        Runs(("tests/session/test_server_turns.py::test_v2_incremental_r3_of_each_leaf_matches_its_full_r3_oracle",)),
    ),
    "session.host": (Runs(("tests/session/test_standalone_server.py::test_cli_flags_map_onto_the_config",)),),
    "session.port": (Runs(("tests/session/test_standalone_server.py::test_cli_flags_map_onto_the_config",)),),
    "session.tito_model": (
        Runs(
            (
                "tests/session/test_tito_families.py::test_the_qwen3_server_renders_tool_results_with_its_fixed_template",
                "tests/session/test_tito_families.py::test_the_standalone_server_exits_at_start_for_a_family_its_model_cannot_serve",
            )
        ),
        Refused("tito-model-needs-session", "qwen3"),
        Refused("tito-model-fits-tokenizer", "glm47", TINY),
    ),
    "session.message_matcher": (
        Runs(
            (
                "tests/session/test_message_matchers.py::test_v1_keeps_the_checkpoint_only_when_the_matcher_accepts_the_replay",
                "tests/session/test_message_matchers.py::test_v2_attaches_the_replay_under_the_stored_node_only_when_the_matcher_accepts_it",
            )
        ),
    ),
    "session.max_trim_tokens": (
        Runs(("tests/session/test_linear.py::test_trailing_differences_within_max_trim_tokens_are_allowed",)),
    ),
    "session.upstream_timeout_s": (
        Runs(
            (
                "tests/session/test_server_faults.py::test_an_engine_that_times_out_gives_502_and_the_session_stays_usable",
            )
        ),
    ),
    "session.max_sessions": (
        Runs(
            (
                "tests/session/test_standalone_server.py::test_the_plans_session_limits_and_key_reach_the_server",
                "tests/session/test_session_limits.py::test_more_sessions_than_the_cap_is_429_naming_the_setting",
            )
        ),
        Refused("session-limits-fit-rollout", "0"),
        Refused("session-limits-fit-rollout", "2", TINY),
    ),
    "session.max_age_s": (
        Runs(
            (
                "tests/session/test_standalone_server.py::test_the_plans_session_limits_and_key_reach_the_server",
                "tests/session/test_session_limits.py::test_an_expired_session_is_gone_and_its_resources_freed",
            )
        ),
        Refused("session-limits-fit-rollout", "0"),
    ),
    # ---- rollout ----
    "rollout.task": (
        Runs(("tests/multi_lora/test_rollout_data.py::test_adapters_on_the_jsonl_task_read_their_own_data_files",)),
    ),
    "rollout.reward": (Runs((f"{DRIVER}::test_run_logs_one_metrics_record_per_step_with_weight_versions",)),),
    "rollout.agent": (
        Runs(
            (
                "tests/multi_lora/test_agentic_rollout.py::test_an_adapters_registered_agent_is_kept_and_none_means_the_runs_agent",
            )
        ),
    ),
    "rollout.data": (
        Runs(("tests/multi_lora/test_rollout_data.py::test_adapters_on_the_jsonl_task_read_their_own_data_files",)),
    ),
    "rollout.rollout_batch_size": (
        Runs((f"{DRIVER}::test_run_logs_one_metrics_record_per_step_with_weight_versions",)),
    ),
    "rollout.n_samples_per_prompt": (
        Runs(("tests/multi_lora/test_batch_collection.py::test_groups_leave_in_whole_dp_chunks",)),
    ),
    "rollout.max_response_len": (
        Runs(
            (
                "tests/sglang_client/test_rollout_sampling.py::test_single_turn_requests_sample_with_the_plans_settings",
                "tests/sglang_client/test_rollout_sampling.py::test_session_turns_sample_with_the_plans_settings",
            )
        ),
    ),
    "rollout.max_turns": (
        Runs(("tests/rollout/test_tasks.py::test_guess_number_ends_after_max_turns_and_asks_for_a_number",)),
    ),
    "rollout.temperature": (
        Runs(
            (
                "tests/sglang_client/test_rollout_sampling.py::test_single_turn_requests_sample_with_the_plans_settings",
                "tests/sglang_client/test_rollout_sampling.py::test_session_turns_sample_with_the_plans_settings",
            )
        ),
    ),
    "rollout.top_p": (
        Runs(
            (
                "tests/sglang_client/test_rollout_sampling.py::test_single_turn_requests_sample_with_the_plans_settings",
                "tests/sglang_client/test_rollout_sampling.py::test_session_turns_sample_with_the_plans_settings",
            )
        ),
    ),
    "rollout.top_k": (
        Runs(
            (
                "tests/sglang_client/test_rollout_sampling.py::test_single_turn_requests_sample_with_the_plans_settings",
                "tests/sglang_client/test_rollout_sampling.py::test_session_turns_sample_with_the_plans_settings",
            )
        ),
    ),
    "rollout.schedule": (Runs((f"{DRIVER}::test_async_schedule_overlaps_generation_and_trains_one_version_stale",)),),
    "rollout.fully_async": (Refused("fully-async-not-built", "true"),),
    "rollout.max_weight_staleness": (
        Runs(
            (
                "tests/loops/test_sync_schedule.py::test_a_batch_beyond_the_bound_stops_the_run_naming_the_settings",
                f"{DRIVER}::test_async_schedule_overlaps_generation_and_trains_one_version_stale",
            )
        ),
        Refused(
            "update-interval-within-staleness",
            "0",
            ("weight_sync.update_weights_interval=2", "rollout.max_weight_staleness=1"),
        ),
    ),
    "rollout.partial_rollout": (Refused("partial-rollout-not-built", "true"),),
    "rollout.group_rm": (Refused("group-rm-not-built", "true"),),
    "rollout.recompute_logprobs_via_prefill": (Refused("prefill-logprob-recompute-not-built", "true"),),
    "rollout.routing_replay": (
        Runs(
            (
                "tests/trainer/test_routing_replay.py::test_training_routes_every_token_as_the_rollout_did_after_the_routers_moved",
                "tests/trainer/test_routing_replay.py::test_rollout_routing_replay_in_the_plan_turns_replay_on_in_its_trainer",
                "tests/trainer/test_routing_replay_engine.py::test_single_turn_samples_carry_the_engines_rows_for_every_token_but_the_last",
            )
        ),
        Refused("routing-replay-needs-moe", "true", ("model=tiny_dense",)),
    ),
    "rollout.indexer_replay": (Refused("indexer-replay-needs-dsa", "true"),),
    # ---- weight sync ----
    "weight_sync.pause_generation_mode": (
        Runs(("tests/weight_sync/test_tensor_sync.py::test_push_pauses_running_requests_and_continues_them",)),
    ),
    "weight_sync.transfer_mode": (Refused("lora-sync-needs-broadcast", "p2p"),),
    "weight_sync.update_weights_interval": (
        Runs(
            (
                f"{WEIGHT_SYNC}::test_the_engines_weight_version_changes_only_every_interval_steps_and_after_the_last",
                f"{WEIGHT_SYNC}::test_a_resumed_run_keeps_the_schedule_and_pushes_the_checkpoint_adapter_first",
            )
        ),
        Refused("multi-lora-pushes-every-step", "2", TINY_MULTI),
    ),
    "weight_sync.verify": (
        Runs(
            (
                f"{WEIGHT_SYNC}::test_every_push_is_probed_on_the_engine_against_the_trainer",
                "tests/weight_sync/test_verify.py::test_a_healthy_push_passes_the_probe_on_every_engine",
                "tests/loops/test_learning.py::test_a_frozen_adapter_stops_the_verified_run_before_the_trainer_steps_on_its_rollouts",
                "tests/loops/test_learning.py::test_a_frozen_adapter_stops_the_async_schedule_at_its_first_push_after_step_0",
                "tests/multi_lora_e2e/test_push_probe.py::test_a_frozen_adapter_stops_a_multi_lora_run_at_its_first_push_after_a_step",
            )
        ),
    ),
    "weight_sync.max_logprob_gap": (
        Runs(
            (
                "tests/weight_sync/test_verify.py::test_an_engine_that_keeps_the_old_adapter_fails_the_probe_by_name",
                "tests/loops/test_learning.py::test_a_frozen_adapter_stops_the_verified_run_before_the_trainer_steps_on_its_rollouts",
            )
        ),
        Refused("max-logprob-gap-positive", "0"),
    ),
    "weight_sync.check_weight_equal": (Refused("check-weight-equal-cannot-read-adapters", "true"),),
    # ---- optimizer ----
    "optimizer.name": (
        Runs(
            (
                f"{OPTIONS}::test_muon_steps_each_lora_matrix_by_an_orthogonalised_update",
                "tests/trainer/test_plan_settings.py::test_the_fsdp_optimizer_takes_the_plans_hyperparameters",
            )
        ),
        Refused("muon-needs-whole-matrices", "muon"),
    ),
    "optimizer.lr": (Runs(("tests/multi_lora/test_config.py::test_a_plan_adapter_registers_with_its_own_values",)),),
    "optimizer.weight_decay": (
        Runs(
            (
                "tests/trainer/test_plan_settings.py::test_the_fsdp_optimizer_takes_the_plans_hyperparameters",
                "tests/trainer/test_plan_settings.py::test_each_adapter_slots_optimizer_takes_the_plans_hyperparameters",
            )
        ),
        Runs(
            ("tests/trainer/test_plan_settings.py::test_weight_decay_shrinks_the_adapter_by_lr_times_decay_each_step",)
        ),
    ),
    "optimizer.adam_beta1": (
        Runs(
            (
                "tests/trainer/test_plan_settings.py::test_the_fsdp_optimizer_takes_the_plans_hyperparameters",
                "tests/trainer/test_plan_settings.py::test_each_adapter_slots_optimizer_takes_the_plans_hyperparameters",
            )
        ),
    ),
    "optimizer.adam_beta2": (
        Runs(
            (
                "tests/trainer/test_plan_settings.py::test_the_fsdp_optimizer_takes_the_plans_hyperparameters",
                "tests/trainer/test_plan_settings.py::test_each_adapter_slots_optimizer_takes_the_plans_hyperparameters",
            )
        ),
    ),
    "optimizer.clip_grad": (
        Runs(
            (
                "tests/trainer/test_plan_settings.py::test_the_fsdp_step_is_clipped_at_optimizer_clip_grad",
                "tests/trainer/test_plan_settings.py::test_an_adapter_slots_step_is_clipped_at_optimizer_clip_grad",
            )
        ),
    ),
    "optimizer.use_distributed_optimizer": (Refused("fsdp-optimizer-is-distributed", "false"),),
    "optimizer.cpu_offload": (
        Runs(
            (
                "tests/trainer/megatron/test_cpu_offload_optimizer.py::test_a_cpu_host_keeps_the_trainers_optimizer_and_the_plan_says_so",
                "tests/trainer/megatron/test_cpu_offload_optimizer.py::test_megatron_builds_the_hybrid_optimizer_with_miles_settings",
            )
        ),
        Refused("optimizer-cpu-offload-needs-megatron", "true"),
        Refused("optimizer-cpu-offload-needs-adam-or-sgd", "true", (*MEGATRON_CPU, "optimizer.name=muon")),
    ),
    # ---- algorithm ----
    "algorithm.advantage_estimator": (
        Runs(
            (
                "tests/trainer/test_advantages.py::test_reinforce_plus_plus_baseline_subtracts_the_group_mean_and_the_kl_penalty_then_whitens",
                f"{OPTIONS}::test_each_estimator_raises_the_rewarded_response_and_lowers_the_other",
            )
        ),
        Refused("ppo-needs-critic", "ppo"),
    ),
    "algorithm.gamma": (
        Runs(
            (
                "tests/trainer/test_advantages.py::test_reinforce_plus_plus_discounts_kl_penalised_token_rewards_then_whitens",
            )
        ),
        Refused("gamma-needs-reinforce", "0.9"),
    ),
    "algorithm.num_steps": (Runs((f"{DRIVER}::test_run_logs_one_metrics_record_per_step_with_weight_versions",)),),
    "algorithm.global_batch_size": (Runs((f"{FSDP}::test_global_batch_size_gives_one_optimizer_step_per_batch",)),),
    "algorithm.eps_clip": (Runs((f"{LOSS}::test_clip_is_asymmetric",)),),
    "algorithm.eps_clip_high": (Runs((f"{LOSS}::test_clip_is_asymmetric",)),),
    "algorithm.kl_coef": (Runs((f"{FSDP}::test_kl_to_the_base_is_zero_before_the_adapter_moves_and_positive_after",)),),
    "algorithm.entropy_coef": (Runs((f"{LOSS}::test_entropy_bonus_lowers_the_loss",)),),
    "algorithm.normalize_advantages_by_std": (
        Runs(
            (
                "tests/trainer/test_plan_settings.py::test_normalize_advantages_by_std_makes_the_step_blind_to_the_reward_scale",
            )
        ),
    ),
    "algorithm.use_tis": (Runs((f"{LOSS}::test_tis_weights_tokens_by_the_truncated_old_over_rollout_ratio",)),),
    "algorithm.use_rollout_logprobs": (Runs((f"{FSDP}::test_using_rollout_log_probs_requires_them",)),),
    # ---- checkpoints ----
    "checkpoint.interval": (Runs((f"{DRIVER}::test_sigkill_mid_run_resumes_with_no_step_lost_or_repeated",)),),
    "checkpoint.keep_last": (
        Runs(
            (
                "tests/loops/test_checkpoint_pruning.py::test_the_single_adapter_loop_keeps_the_last_keep_last_checkpoints",
                "tests/loops/test_checkpoint_pruning.py::test_each_multi_lora_adapter_keeps_its_last_keep_last_checkpoints",
            )
        ),
    ),
    # ---- executor ----
    "executor.kind": (
        Runs(
            (
                "tests/executors/test_ray_executor.py::test_ray_executor_serves_the_plan_restarts_a_dead_engine_and_stops_every_process",
            )
        ),
    ),
    "executor.ray_address": (
        Runs(
            (
                "tests/executors/test_ray_address.py::test_the_ray_executor_runs_the_plan_on_the_cluster_at_ray_address_and_leaves_it_up",
            )
        ),
    ),
    "executor.health_timeout_s": (
        Runs(
            (
                "tests/executors/test_plan_engines.py::test_a_service_not_healthy_within_executor_health_timeout_s_fails_naming_it",
            )
        ),
    ),
    "executor.engine_restarts": (
        Runs(
            (
                "tests/executors/test_engine_restart.py::test_a_dead_engine_comes_back_on_its_port_behind_the_router_until_the_budget_is_spent",
                "tests/reliability/test_engine_killed_mid_rollout.py::test_with_a_restart_the_run_finishes_with_every_step_trained_once",
            )
        ),
    ),
    # ---- logger ----
    "logger.wandb_mode": (
        Runs(
            (
                "tests/tracking/test_wandb_run.py::test_an_offline_run_records_the_plans_project_name_and_tags",
                "tests/tracking/test_wandb_run.py::test_disabled_wandb_writes_no_wandb_folder",
            )
        ),
    ),
    "logger.project": (
        Runs(("tests/tracking/test_wandb_run.py::test_an_offline_run_records_the_plans_project_name_and_tags",)),
    ),
    "logger.run_name": (
        Runs(
            (
                "tests/tracking/test_wandb_run.py::test_an_offline_run_records_the_plans_project_name_and_tags",
                "tests/tracking/test_wandb_run.py::test_without_a_run_name_the_wandb_run_is_named_after_the_run",
            )
        ),
    ),
    "logger.tags": (
        Runs(("tests/tracking/test_wandb_run.py::test_an_offline_run_records_the_plans_project_name_and_tags",)),
    ),
    "logger.metrics_jsonl": (
        Runs(
            (
                "tests/tracking/test_tracker_switches.py::test_without_metrics_jsonl_no_file_is_written_and_the_plot_and_summary_still_cover_every_step",
            )
        ),
        Refused("metrics-jsonl-needed-to-resume", "false", ("run.resume=true",)),
    ),
    "logger.plots": (Runs((f"{DRIVER}::test_run_leaves_plot_checkpoints_and_offline_wandb",)),),
    "logger.progress": (
        Runs(("tests/tracking/test_tracking.py::test_progress_on_a_terminal_draws_a_live_bar_and_keeps_step_lines",)),
    ),
    # ---- security: the run's key, by the name of the variable that holds it ----
    "security.api_key_env": (
        Runs(
            (
                "tests/executors/test_run_key.py::test_every_server_of_a_keyed_run_refuses_a_request_without_its_key",
                "tests/executors/test_run_key.py::test_a_keyed_run_with_a_session_server_trains_end_to_end_and_writes_no_key",
            )
        ),
        Refused("api-key-env-is-a-variable-name", "my-key"),
    ),
    # ---- one multi-LoRA adapter (adapters.runs[i]); unset values take the adapters.* and rollout.* defaults ----
    "adapters.runs[].name": (Runs((f"{MULTI_CONFIG}::test_a_plan_adapter_registers_with_its_own_values",)),),
    "adapters.runs[].task": (Runs((f"{MULTI_CONFIG}::test_a_plan_adapter_registers_with_its_own_values",)),),
    "adapters.runs[].reward": (Runs((f"{MULTI_CONFIG}::test_a_plan_adapter_registers_with_its_own_values",)),),
    "adapters.runs[].rank": (Runs((f"{MULTI_CONFIG}::test_a_plan_adapter_registers_with_its_own_values",)),),
    "adapters.runs[].alpha": (Runs((f"{MULTI_CONFIG}::test_a_plan_adapter_registers_with_its_own_values",)),),
    "adapters.runs[].target_modules": (
        Runs((f"{MULTI_CONFIG}::test_target_modules_the_engines_do_not_serve_are_rejected",)),
    ),
    "adapters.runs[].lr": (Runs((f"{MULTI_CONFIG}::test_a_plan_adapter_registers_with_its_own_values",)),),
    "adapters.runs[].rollout_batch_size": (
        Runs(("tests/multi_lora/test_registry.py::test_resolve_num_step_is_rows_over_rollout_batch_size_when_unset",)),
    ),
    "adapters.runs[].n_samples_per_prompt": (
        Runs((f"{MULTI_CONFIG}::test_adapter_global_batch_size_is_groups_times_samples",)),
    ),
    "adapters.runs[].num_step": (
        Runs(("tests/multi_lora/test_registry.py::test_num_step_retires_the_adapter_when_reached",)),
    ),
    "adapters.runs[].num_epoch": (
        Runs(("tests/multi_lora/test_registry.py::test_resolve_num_step_multiplies_by_num_epoch",)),
    ),
    "adapters.runs[].data": (
        Runs(("tests/multi_lora/test_rollout_data.py::test_adapters_on_the_jsonl_task_read_their_own_data_files",)),
    ),
    "adapters.runs[].agent": (
        Runs(
            (
                "tests/multi_lora/test_agentic_rollout.py::test_an_adapters_registered_agent_is_kept_and_none_means_the_runs_agent",
            )
        ),
    ),
}
