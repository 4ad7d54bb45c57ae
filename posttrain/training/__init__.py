"""What every training stage shares: the harness around its step (the step itself stays in `stages/<stage>.py`).

- `harness`: `StageRun` (flags, config, processes and mesh, seeding, model builds, resume, the
  step loop with metrics, progress, checkpoints and stop-on-SIGTERM, the final save).
- `optimization`: `Optimization` (optimizer, schedule, clipping, non-finite guard, gradient scale).
- `setup`: `seed_everything`, `model_config`, `build_model`, `build_optimizer_and_scheduler`.
- `checkpointer`: `Checkpointer` (DCP resume state in `<out>.resume/`), `resume_dir`.
- `signals`: `StopOnSignal`. `result_log`: `ResultLog` (numbered work items kept across a kill).
- `faults`: `run_main` (every stage's entry), `NonFiniteLossGuard`, `SettingError`, `explain_out_of_memory`,
  `exit_on_known_errors`.
- `held_out`: `held_out_means` (per-token means over a split, every rank in every batch).
- `stats`: `data_parallel_sum`, `max_over_ranks`, `local_value`, `non_pad_tokens`.
- `final_model`: `save_final_model` (gather, merge LoRA, HF folder + PEFT adapter + metrics + provenance, atomic).
"""
