"""Compatibility with Lightning's ``FSDPStrategy`` and ``ModelParallelStrategy``.

What Lightning's own tests check of those two strategies, checked here of ``lightning_shard.ShardStrategy`` (the
Trainer's) and ``lightning_shard.fabric.ShardStrategy`` (Fabric's), on CPU with gloo, in our own words and with our
own small models. Run it with ``make test`` (pytest collects ``tests/compat``), or alone::

    OMP_NUM_THREADS=1 .venv/bin/pytest -q tests/compat

Multi-rank checks run on 2 pooled gloo ranks (``lightning_shard.testing.run_on_ranks``; a ``Trainer`` or ``Fabric``
runs inside each worker as that rank), one worker call per test. Helpers and models are in ``support.py``.

Files:

- ``test_trainer_fsdp.py``: ``tests/tests_pytorch/strategies/test_fsdp.py``.
- ``test_fabric_fsdp.py``: ``tests/tests_fabric/strategies/test_fsdp.py`` and ``test_fsdp_integration.py``.
- ``test_model_parallel.py``: ``tests/tests_pytorch/strategies/test_model_parallel.py``,
  ``test_model_parallel_integration.py`` and their Fabric counterparts, for what is not tensor parallelism; what
  ModelParallelStrategy shares with FSDPStrategy is checked once, in the two FSDP files.

Every Lightning test is listed below, with what it checks, in one of three classes:

- **[a]** applies: the named test here checks the same behaviour and passes;
- **[b]** does not apply (the reason is given): GPU-only, PyTorch-FSDP or DCP internals, mocks of private helpers;
- **[c]** a deliberate difference: the named test here checks *our* behaviour, and docs/migration.md, "Differences
  from FSDPStrategy and ModelParallelStrategy", gives the reason, one row per difference.

T = ``test_trainer_fsdp``, F = ``test_fabric_fsdp``, M = ``test_model_parallel``.

tests_pytorch/strategies/test_fsdp.py (FSDPStrategy, Trainer)
-------------------------------------------------------------

- test_invalid_on_cpu: a CPU accelerator is refused. [c] T.test_runs_on_cpu_where_fsdp_needs_a_gpu
- test_custom_mixed_precision: an explicit config is ``mixed_precision_config``. [a]
  T.test_custom_mixed_precision_is_the_strategys_config, ..._flags_that_cannot_be_honoured_are_refused [c],
  ..._keeps_batchnorm_in_full_precision_with_a_wrap_policy
- test_strategy_sync_batchnorm: ``sync_batchnorm=True`` through every stage. [a] T.test_sync_batchnorm_runs_every_stage
  (SyncBatchNorm has no CPU kernels: the test lends it the CPU stand-ins of ``tests/test_buffers.py``)
- test_modules_without_parameters: a torchmetrics metric lives on the device. [a]
  T.test_a_metric_without_parameters_works_in_the_training_step
- test_strategy_checkpoint[sharded|full x 32-true|bf16-mixed]: fit, test, save (also weights only), test and
  predict from the checkpoint. [a] T.test_all_stages_run_and_checkpoints_restore_the_trained_model (the
  ``load_from_checkpoint`` comparison of a full file does not run for directories in Lightning's test either)
- test_strategy_full_state_dict[2|1024|1e8]: size policy units; full state dict on rank 0 only, plain keys in
  order. [a] T.test_size_based_policy_wraps_what_fsdp_wraps_and_the_full_state_dict_is_on_rank_0 (with
  ``state_dict_type="full"``: the default is "sharded" here, [c])
- test_checkpoint_multi_gpus[manually_wrapped|autowrap_2x|autowrap_use_orig_params]: ``wrap()``, an FSDP policy
  function, ``ModuleWrapPolicy`` + ``use_orig_params``, every stage. [a]
  T.test_checkpoint_stages_with_manual_and_fsdp_style_wrapping,
  T.test_fsdp_policies_choose_what_fsdp_wraps_that_can_be_gathered
- test_invalid_parameters_in_optimizer[None|False|True]: an optimizer over foreign tensors. [a] (default flags)
  T.test_an_optimizer_over_tensors_outside_the_model_trains_and_its_save_is_refused; ``use_orig_params=False`` [c]
- test_forbidden_precision_raises: ``HalfPrecision`` refused with ``TypeError``. [c]
  T.test_a_precision_plugin_the_strategy_cannot_run_is_a_type_error
- test_activation_checkpointing: ``{Block}`` and ``ModuleWrapPolicy`` applied at set-up. [a]
  T.test_activation_checkpointing_policy_takes_classes_and_module_wrap_policy,
  T.test_activation_checkpointing_recomputes_the_chosen_modules
- test_setup_model_device_id_cpu, test_model_sharded_context_device_id_cpu: the ``device_id`` handed to
  ``FullyShardedDataParallel``/``enable_wrap`` on CPU. [b] PyTorch FSDP constructor internals (no FSDP here)
- test_strategy_cpu_offload: bool and ``CPUOffload``. [a] T.test_cpu_offload_takes_a_bool_or_torchs_cpu_offload
  (the attribute is a bool, [c])
- test_sharding_strategy: default, enum, names in any case. [a]
  T.test_sharding_strategy_takes_names_in_any_case_and_both_enums (compare ``.name``: our enum, [c])
- test_hybrid_shard_configuration[HYBRID_SHARD|_HYBRID_SHARD_ZERO2]. [c]
  T.test_hybrid_shard_needs_neither_a_wrap_policy_nor_a_process_group
- test_use_orig_params: default True, False allowed. [a]/[c] T.test_fsdp_flags_are_taken_as_true_and_refused_as_false
- test_set_timeout: the timeout reaches ``init_process_group``. [a] for 10 minutes or more; a shorter one bounds the
  collectives after a 10-minute rendezvous [c] T.test_timeout_reaches_the_process_group
- test_strategy_load_optimizer_states_multiple: optimizer count mismatch is a ``RuntimeError``. [a]
  T.test_a_checkpoint_with_another_number_of_optimizers_is_a_runtime_error
- test_strategy_save_optimizer_states[2|1024|1e8]: full model/optimizer states on rank 0 only; DDP resumes them.
  [a] T.test_model_and_optimizer_state_are_full_on_rank_0_and_restored_exactly (the DDP resume: [c])
- test_strategy_load_optimizer_states[2|1024|1e8]: a DDP ``.ckpt`` resumes with exact states. [a]
  T.test_a_ddp_checkpoint_resumes_with_its_model_and_optimizer_state
- test_configure_model: device and dtype in ``configure_model`` and after set-up. [a]
  T.test_configure_model_builds_on_the_cpu_and_setup_shards_onto_the_device
- test_save_checkpoint_storage_options: ``TypeError``. [a] T.test_save_checkpoint_refuses_storage_options
- test_save_checkpoint_path_exists: overwrite rules. [c] T.test_save_replaces_a_checkpoint_and_never_other_data
- test_save_checkpoint_unknown_state_dict_type: ``ValueError``. [a] (raised at construction, [c])
  T.test_unknown_state_dict_type_is_a_value_error
- test_load_unknown_checkpoint_type: ``ValueError`` for an empty directory. [a]
  T.test_loading_a_path_that_is_not_a_checkpoint_is_a_value_error
- test_save_load_sharded_state_dict: layout, metadata without tensors, exact resume. [a] (file names differ, [c])
  T.test_sharded_checkpoint_layout_and_resume
- test_lazy_load_full_state_dict: ``_lazy_load`` is used for a full file. [b] mocks a private torch.load path;
  here each rank reads only its rows by construction
- test_load_full_checkpoint_remote_honors_explicit_weights_only,
  test_load_full_checkpoint_remote_allows_non_tensor_objects, test_load_sharded_checkpoint_metadata_weights_only:
  ``torch.load(weights_only=...)`` for remote pickles. [b] no checkpoint of ours is a pickle
- test_module_init_context[32-true|16-true|bf16-true]: ``init_module(empty_init)`` device and dtype. [a]
  T.test_init_module_builds_in_the_precisions_dtype_and_setup_places_it
- test_save_sharded_and_consolidate_and_load: consolidate to one file, DDP resumes. [a] for the model
  T.test_a_sharded_checkpoint_consolidates_into_one_file_a_plain_model_loads; the DDP resume with optimizer [c]
- test_device_mesh_type_annotation: jsonargparse parses ``[1, 4]``. [a]
  T.test_device_mesh_annotation_parses_a_pair_from_the_command_line
- test_pl_save_checkpoint_does_not_corrupt_remote_path: a ``gs://`` URL is not turned into ``gs:/``. [a]
  T.test_a_url_reaches_the_storage_layer_whole

tests_fabric/strategies/test_fsdp.py (FSDPStrategy, Fabric)
-----------------------------------------------------------

- test_custom_mixed_precision [a] F.test_custom_mixed_precision_is_the_strategys_config
- test_cpu_offload [a] F.test_cpu_offload_takes_a_bool_or_torchs_cpu_offload
- test_sharding_strategy [a] F.test_sharding_strategy_takes_names_in_any_case_and_both_enums
- test_hybrid_shard_configuration[2] [c] F.test_hybrid_shard_needs_neither_a_wrap_policy_nor_a_process_group
- test_checkpoint_io_unsupported: ``NotImplementedError`` on get/set. [a] F.test_checkpoint_io_unsupported
- test_setup_use_orig_params: False refused at joint set-up; default works. [c] (refused at construction)
  F.test_fsdp_flags_are_taken_as_true_and_refused_as_false,
  F.test_joint_setup_keeps_parameter_groups_on_the_layers_parameters
- test_no_backward_sync: ``TypeError`` for an unwrapped module; the context defers the reduction. [a]
  F.test_no_backward_sync_needs_a_set_up_module,
  F.test_no_backward_sync_holds_the_reduction_back_and_the_gradients_add_up
- test_activation_checkpointing [a] F.test_activation_checkpointing_recomputes_the_chosen_modules
- test_setup_module_device_id_cpu, test_module_sharded_context_device_id_cpu [b] FSDP constructor internals
- test_forbidden_precision_raises [c] F.test_a_precision_plugin_the_strategy_cannot_run_is_a_type_error
- test_grad_clipping_norm_error: ``TypeError`` for an unwrapped module. [a]
  F.test_clipping_by_norm_needs_a_set_up_module
- test_save_checkpoint_storage_options [a] F.test_save_checkpoint_refuses_storage_options
- test_save_checkpoint_path_exists [c] F.test_save_replaces_a_checkpoint_and_never_other_data
- test_save_checkpoint_one_fsdp_module_required, test_load_checkpoint_one_fsdp_module_required: exactly one
  sharded module per checkpoint (``ValueError``); a raw module loads. [a]
  F.test_a_checkpoint_holds_exactly_one_set_up_module
- test_load_checkpoint_no_state: ``ValueError`` for None/{}. [a] F.test_loading_needs_a_state_to_fill
- test_save_checkpoint_unknown_state_dict_type [a] F.test_unknown_state_dict_type_is_a_value_error
- test_load_unknown_checkpoint_type [a] F.test_loading_a_path_that_is_not_a_checkpoint_is_a_value_error
- test_load_raw_checkpoint_validate_single_file: ``load_raw`` of a folder is a ``ValueError``. [a] for a folder
  that is no checkpoint, F.test_loading_a_path_that_is_not_a_checkpoint_is_a_value_error; a checkpoint folder
  is read [c]
- test_load_raw_checkpoint_optimizer_unsupported: ``NotImplementedError``. [a]
  F.test_loading_a_bare_optimizer_is_not_implemented
- test_set_timeout [a]/[c] as in the Trainer's file, F.test_timeout_reaches_the_process_group
- test_get_full_state_dict_context_offload: ``offload_to_cpu`` of FSDP's state-dict config. [b] FSDP internals
- test_device_mesh_type_annotation [a] F.test_device_mesh_annotation_parses_a_pair_from_the_command_line
- test_warn_shared_params_across_fsdp_units: a warning for tied weights in two units. [c]
  F.test_shared_parameters_need_no_warning_and_stay_tied[tied weights across units]
- test_no_warn_shared_params_same_fsdp_unit, test_no_warn_no_shared_params, test_no_warn_no_policy [a]
  F.test_shared_parameters_need_no_warning_and_stay_tied[...]
- test_is_full_checkpoint_remote_memory, test_is_sharded_checkpoint_remote_memory,
  test_distributed_checkpoint_reader_writer_selection, test_load_raw_module_state_from_path_remote,
  test_get_distributed_checkpoint_writer_missing_fsspec_module,
  test_get_distributed_checkpoint_reader_missing_fsspec_module: Lightning's private DCP/fsspec helpers. [b]
- test_load_full_checkpoint_remote_allows_non_tensor_objects,
  test_load_full_checkpoint_remote_honors_explicit_weights_only, test_load_sharded_checkpoint_metadata_weights_only:
  ``torch.load(weights_only=...)`` of remote pickles. [b]
- test_save_checkpoint_does_not_corrupt_remote_path [a] F.test_a_url_reaches_the_storage_layer_whole

tests_fabric/strategies/test_fsdp_integration.py
------------------------------------------------

- test_train_save_load[manual|auto x 16-mixed|bf16-mixed]: exact restore, values, ``KeyError`` for a missing key,
  ``strict=False``. [a] F.test_train_save_and_load_restore_model_optimizer_and_values (32-true and bf16-mixed: no
  fp16 autocast on CPU; the file list is ours, [c])
- test_save_full_state_dict: full layout as one file; back into FSDP, into one device, and one device into FSDP.
  [a] F.test_full_state_dict_is_one_model_file_and_loads_back_exactly,
  F.test_a_single_device_checkpoint_loads_into_the_sharded_model; one file read by ``torch.load`` and the load
  into a one-device Fabric [c]
- test_load_full_state_dict_into_sharded_model: a one-device checkpoint, then a raw state dict (``load_raw``). [a]
  F.test_a_single_device_checkpoint_loads_into_the_sharded_model,
  F.test_a_plain_models_weights_load_into_the_sharded_model (a raw ``torch.save`` state dict too, read with
  ``torch.load(weights_only=True)``)
- test_setup_module_move_to_device[True|False] [a]
  F.test_setup_module_shards_onto_the_device_whatever_move_to_device_says
- test_setup_with_orig_params_and_multiple_param_groups [a]
  F.test_joint_setup_keeps_parameter_groups_on_the_layers_parameters
- test_reapply_compile: ``fabric.setup(compiled, _reapply_compile=True)``. [b] here: one compile takes about a
  minute on 2 CPU ranks, over this suite's budget; compiled blocks are checked in tests/test_compile.py
- test_module_init_context[32-true|16-true|bf16-true] [a]
  F.test_init_module_builds_in_the_precisions_dtype_and_setup_places_it
- test_save_filter: filter for full, ``NotImplementedError`` for sharded. [a]/[c]
  F.test_save_with_a_filter_writes_only_the_filtered_keys
- test_manual_activation_checkpointing: warning for a model already checkpointed. [a]
  F.test_a_model_checkpointed_by_hand_gets_a_warning
- test_rewrap_warnings: manual wrap skips the policy; meta weights stay. [c]
  F.test_units_by_hand_and_by_policy_together_and_meta_weights_are_materialised
- test_clip_gradients[norm (skipped in Lightning)|val x precisions] [a] F.test_clip_gradients_by_norm_and_by_value
- test_save_sharded_and_consolidate_and_load: consolidate, load into a new sharded model. [a]
  F.test_a_sharded_checkpoint_consolidates_and_loads_into_a_new_sharded_model (model only; optimizer from the
  directory, [c])
- test_no_call_to_apply: ``FSDP.apply`` is not called. [b] FSDP internals

tests_pytorch/strategies/test_model_parallel.py and tests_fabric/strategies/test_model_parallel.py
--------------------------------------------------------------------------------------------------

- test_torch_greater_equal_2_4 (both) [b] a torch version gate
- test_device_mesh_access (both): ``RuntimeError`` before set-up. [a]
  M.test_the_device_mesh_before_set_up_is_refused_in_model_parallel_strategys_words,
  M.test_the_mesh_is_not_available_before_the_processes_are_set_up
- test_validate_device_mesh_dimensions[5] (both): ``data_parallel_size`` x ``tensor_parallel_size`` other than the
  world size. [a] M.test_parallel_sizes_that_do_not_multiply_to_the_world_are_refused_before_any_rank_is_assigned
  (a ``RuntimeError`` in ModelParallelStrategy's words, also a ``ValueError``); a ``device_mesh=(replicas,
  shard_size)`` that does not cover the world: ``ValueError`` [c]
  M.test_a_mesh_that_does_not_cover_the_world_is_refused_before_the_process_group
- test_fsdp_v1_modules_unsupported (both): FSDP-wrapped modules refused with ``TypeError``. [a]
  M.test_a_model_already_sharded_by_torchs_fsdp_is_refused
- test_configure_model_required (Trainer) [c] M.test_configure_model_is_optional
- test_parallelize_fn_call (Fabric) [a]
  M.test_parallelize_fn_applies_a_tensor_parallel_plan_and_needs_tensor_parallelism and
  tests/test_tensor_parallel.py (called with the mesh in ``setup_module``)
- test_checkpoint_io_unsupported (Fabric) [a] F.test_checkpoint_io_unsupported
- test_no_backward_sync (Fabric) [a] F.test_no_backward_sync_holds_the_reduction_back_and_the_gradients_add_up
- test_save_checkpoint_storage_options (both) [a] T./F.test_save_checkpoint_refuses_storage_options
- test_save_checkpoint_path_exists (both) [c] T./F.test_save_replaces_a_checkpoint_and_never_other_data
- test_save_checkpoint_one_dist_module_required, test_load_checkpoint_one_dist_module_required (Fabric) [a]
  F.test_a_checkpoint_holds_exactly_one_set_up_module
- test_load_checkpoint_no_state (Fabric) [a] F.test_loading_needs_a_state_to_fill
- test_load_unknown_checkpoint_type (both) [a] T./F.test_loading_a_path_that_is_not_a_checkpoint_is_a_value_error
- test_load_raw_checkpoint_validate_single_file (Fabric) [a]/[c] as under FSDP above
- test_load_raw_checkpoint_optimizer_unsupported (Fabric) [a] F.test_loading_a_bare_optimizer_is_not_implemented
- test_set_timeout (both) [a]/[c] as under FSDP, T./F.test_timeout_reaches_the_process_group
- test_meta_device_materialization (both): nothing left on meta, a warning naming modules without
  ``reset_parameters()``. [a] M.test_set_up_materialises_a_meta_model_and_names_modules_without_reset_parameters
- test_align_compiled_param_names_with_module, test_align_compiled_param_names_no_compile (Trainer): a private
  helper rekeying DCP optimizer state for compiled submodules. [b]
- test_model_parallel_pytorch_save_checkpoint_remote_path (Trainer),
  test_model_parallel_save_checkpoint_does_not_corrupt_remote_path,
  test_model_parallel_load_checkpoint_does_not_corrupt_remote_path (Fabric) [a]
  T./F.test_a_url_reaches_the_storage_layer_whole
- test_model_parallel_load_checkpoint_loads_non_tensor_metadata (Fabric): pickled objects round-trip. [c]
  M.test_plain_values_round_trip_and_arbitrary_objects_are_refused

tests_pytorch/strategies/test_model_parallel_integration.py and tests_fabric/.../test_model_parallel_integration.py
------------------------------------------------------------------------------------------------------------------

- test_setup_device_mesh (both): the mesh and its sizes. [c] (``strategy.mesh`` is the data-parallel
  ``(replicas, shard_size)`` layout; ``device_mesh`` exists with ``tensor_parallel_size > 1``)
  M.test_the_mesh_has_the_configured_shape_in_configure_model_and_after_launch
- test_tensor_parallel, test_fsdp2_tensor_parallel (both) [a] tests/test_tensor_parallel.py: a Colwise/Rowwise plan
  at (dp=2, tp=2) against DDP and against ModelParallelStrategy + ``fully_shard``; with compile [b] (over the suite's
  budget)
- test_model_parallel_single_file_checkpoint_with_compile (Trainer) [b] here: compile over the suite's budget
- test_modules_without_parameters (Trainer) [a] T.test_a_metric_without_parameters_works_in_the_training_step
- test_module_init_context (both) [a] T./F.test_init_module_builds_in_the_precisions_dtype_and_setup_places_it
- test_strategy_state_dict[distributed|full] (Trainer) [a]
  M.test_lightning_module_state_dict_is_sharded_on_every_rank_or_full_on_rank_0
- test_load_full_state_checkpoint_into_regular_model (Trainer): DDP resumes a full checkpoint. [c]
  M.test_a_full_checkpoint_holds_a_model_file_a_plain_model_loads
- test_load_standard_checkpoint_into_distributed_model (Trainer) [a]
  M.test_a_ddp_checkpoint_loads_into_the_sharded_model
- test_save_load_sharded_state_dict (Trainer) [a] T.test_sharded_checkpoint_layout_and_resume
- test_train_save_load (Fabric) [a] F.test_train_save_and_load_restore_model_optimizer_and_values
- test_save_full_state_dict (Fabric) [a]/[c] as under FSDP, and M.test_fabric_module_and_optimizer_state_dicts
- test_load_full_state_dict_into_sharded_model (Fabric) [a]/[c] as under FSDP
- test_setup_module_move_to_device (Fabric) [a] F.test_setup_module_shards_onto_the_device_whatever_move_to_device_says
- test_save_filter (Fabric) [a]/[c] F.test_save_with_a_filter_writes_only_the_filtered_keys
- test_clip_gradients (Fabric) [a] F.test_clip_gradients_by_norm_and_by_value
- test_save_sharded_and_consolidate_and_load (Fabric) [a]
  F.test_a_sharded_checkpoint_consolidates_and_loads_into_a_new_sharded_model
- test_load_raw_module_state (Fabric): parameters and buffers; a missing key under strict. [a] (a ``RuntimeError``,
  as FSDPStrategy, not ModelParallelStrategy's ``KeyError``: [c])
  M.test_load_raw_fills_parameters_and_buffers_and_is_strict_about_keys
- test_save_sharded_and_consolidate_and_load_remote (Fabric): the same over ``local://``. [a]
  F.test_a_url_reaches_the_storage_layer_whole
"""
