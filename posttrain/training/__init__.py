"""What every training stage shares outside its loop (the loop itself stays in `stages/<stage>.py`).

- `setup`: `seed_everything`, `model_config(source, tokenizer)`, `build_model(source, hf_config, info,
  mesh, cfg, method, lora_cfg)`, `build_optimizer_and_scheduler(model, stage_cfg, memory_cfg)`,
  `max_grad_norm(stage_cfg)`.
- `resume`: `Checkpointer(out, every, key)` (`load`, `due`, `save`, `latest`, `remove`,
  `metrics_path`), `StopOnSignal` (SIGTERM -> checkpoint at the next step boundary, exit 143).
- `faults`: `NonFiniteLossGuard`, `explain_out_of_memory`, `exit_on_known_errors`, `kill_if_requested`.
- `stats`: `data_parallel_sum`, `local_value`, `non_pad_tokens`.
- `export`: `save_final_model` (gather, merge LoRA, HF folder + PEFT adapter + metrics + provenance, atomic).
"""
