"""The pipeline's report and README table, built from finished stage outputs (no training or model code).

- `inputs`: what the report reads of a results tree; `summary`, `effects`: per-stage numbers and the
  change each stage makes; `curves`, `plots`: training curves; `stage_times`: wall time per stage;
  `machine`: the CPU/GPU a number was measured on; `readme_table`: the README's results table.
"""
