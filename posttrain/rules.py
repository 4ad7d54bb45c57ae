"""The rules that relate config keys to each other and to the process layout: one home, torch-free.

The dry run (`posttrain.workflow.preflight`, from each stage's `resources`) and the stages (from the
processes they were started as) call the same functions, so a layout or a setting is refused with the
same words before a job is queued and, if it slipped past, when it starts. Each returns what is
wrong, or nothing; the caller names the key in its own context and reports or raises.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping, Sequence
from typing import Any


def parallel_degrees_problem(cp: int, ep: int) -> str | None:
    """What no process count mends: degrees that do not combine."""
    if ep > 1 and cp > 1:
        return f"parallel.ep ({ep}) and parallel.cp ({cp}): expert and context parallelism do not combine yet; set one to 1"
    return None


def parallel_layout_problem(world: int, tp: int, cp: int, dp_replicate: int, ep: int) -> str | None:
    """What the device mesh refuses of `world` processes under the parallel degrees (None: it builds)."""
    problem = parallel_degrees_problem(cp, ep)
    if problem:
        return problem
    if world % (tp * cp * dp_replicate):
        return (f"parallel.tp ({tp}) x parallel.cp ({cp}) x parallel.dp_replicate ({dp_replicate}) = "
                f"{tp * cp * dp_replicate} does not divide the world size {world}")
    shards = world // (tp * cp * dp_replicate)
    if shards % ep:
        return f"parallel.ep ({ep}) must divide the {shards} FSDP shards (world size {world} / tp x cp x dp_replicate)"
    return None


def optimizer_in_backward_problems(grad_accum: int = 1, max_grad_norm: float | None = None, rows: int | None = None,
                                   micro_batch_size: int | None = None) -> list[tuple[str, str]]:
    """(setting, what is wrong) of what optimizer-in-backward rules out: each parameter is stepped inside its
    backward and its gradient freed, so no accumulation, no clipping, and (`rows` a step's rows per process,
    taken `micro_batch_size` at a time: GRPO) one micro-batch a step."""
    problems = []
    if grad_accum != 1:
        problems.append(("grad_accum", f"{grad_accum}: memory.optimizer_in_backward steps every parameter during "
                         "backward, so it cannot accumulate gradients: set it to 1"))
    if max_grad_norm:
        problems.append(("max_grad_norm", f"{max_grad_norm}: memory.optimizer_in_backward frees each gradient right "
                         "after its step, so there is no norm to clip by: set it to 0 or null"))
    if rows is not None and micro_batch_size is not None and micro_batch_size < rows:
        problems.append(("micro_batch_size", f"{micro_batch_size}: memory.optimizer_in_backward steps during backward, "
                         f"so a step must be one micro-batch: at least {rows} (prompts per process x group_size)"))
    return problems


def batch_split_problem(stage: str, batch: int, accum: int, dp: int) -> str | None:
    """A step's `batch` rows that do not split into `accum` micro-batches on each of `dp` data-parallel processes."""
    if batch % (accum * dp):
        return f"{batch} is not divisible by {stage}.grad_accum ({accum}) x {dp} data-parallel processes"
    return None


def prompt_split_problem(prompts: int, dp: int) -> str | None:
    """GRPO's prompts of a step that do not split evenly over the data-parallel processes."""
    if prompts % dp:
        return f"{prompts} does not split over {dp} data-parallel processes"
    return None


def ppo_problems(parallel: Mapping[str, int], ratio: str) -> list[tuple[str, str]]:
    """What PPO (`grpo.advantage: gae`) refuses of the layout and the ratio: its critic is sharded by data
    parallelism only, and its advantages are per token."""
    problems = []
    for key in ("tp", "cp", "ep"):
        if parallel[key] > 1:
            problems.append((f"parallel.{key}", f"{parallel[key]}: PPO (grpo.advantage: gae) shards its critic "
                             "with data parallelism only; set it to 1"))
    if ratio == "sequence":
        problems.append(("grpo.ratio", "sequence: PPO's advantages are per token; use token"))
    return problems


def adapter_problems(stage: str, method: str, save: str, tp: int, base_is_preset: bool) -> list[tuple[str, str]]:
    """(config key, what is wrong) of a training stage's `method` and `save`: adapters are not sharded by tensor
    parallelism; `save: adapter` needs adapters, and a base that a folder or the hub holds (a preset's random
    weights are in no file an adapter could be applied to)."""
    problems = []
    if method != "full" and tp > 1:
        problems.append((f"{stage}.method", f"{method}: tensor parallelism does not support LoRA/QLoRA adapters; "
                         "set parallel.tp: 1 or method: full"))
    if save == "adapter" and method == "full":
        problems.append((f"{stage}.save", f"adapter: {stage}.method is full, which trains every weight and has no "
                         "adapter to save alone; set method: lora or qlora, or save: merged"))
    elif save == "adapter" and base_is_preset:
        problems.append((f"{stage}.save", "adapter: the stage starts from a preset's random weights, which no folder "
                         "holds for the adapter to apply to; set save: merged or both, or start from a model folder"))
    return problems


def environment_verifier_problem(environment_fn: str | None) -> str | None:
    """The `environment` verifier returns an episode's reward from its environment: without one there is none."""
    if not environment_fn:
        return ("environment: scores a multi-turn episode by its environment's reward, and environment.fn is not "
                "set; set environment.fn (docs/environments.md) or use another verifier")
    return None


def lm_eval_problem(tasks: Sequence[str], optional: bool) -> str | None:
    """lm-evaluation-harness tasks requested where the harness is not installed (unless `eval.lm_eval_optional`)."""
    if tasks and not optional and importlib.util.find_spec("lm_eval") is None:
        return (f"{list(tasks)}: lm-evaluation-harness is not installed (pip install 'posttrain[lm-eval]'); "
                "or set eval.lm_eval_optional: true to skip them where they cannot run")
    return None


# What each training stage's held-out evaluation returns (the keys it logs), and which way is better; the first
# is the stage's default selection metric (`<stage>.metric: null`).
HELD_OUT_METRICS: dict[str, dict[str, str]] = {
    "sft": {"eval_loss": "min"},
    "dpo": {"eval_pref_acc": "max", "eval_pref_margin": "max", "eval_likelihood_acc": "max"},
    "grpo": {"eval_accuracy": "max"},
    "distill": {"eval_divergence": "min", "eval_ce": "min"},
    "reward_model": {"held_out_accuracy": "max"},
}


def held_out_metric(stage: str, metric: str | None) -> tuple[str, str]:
    """(metric, "min" | "max") that `keep: best` and early stopping compare; KeyError names the choices."""
    metrics = HELD_OUT_METRICS[stage]
    name = metric if metric is not None else next(iter(metrics))
    if name not in metrics:
        raise KeyError(f"{name!r} is not what {stage}'s evaluation measures; choose from {', '.join(metrics)}")
    return name, metrics[name]


def selection_problems(stage: str, section: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(config key, what is wrong) of a stage's evaluation during training: `keep: best` and early stopping compare
    evaluations, so they need `eval_every`; the metric is one the stage's evaluation returns."""
    problems = []
    every = int(section.get("eval_every", 0))
    patience = int((section.get("early_stopping") or {}).get("patience", 0))
    for key, wants in (("keep", section.get("keep") == "best"), ("early_stopping.patience", patience > 0)):
        if wants and every == 0:
            problems.append((f"{stage}.{key}", f"compares evaluations during training: set {stage}.eval_every "
                             "(steps between them) above 0"))
    if section.get("epochs") is None and every > int(section["steps"]):  # with epochs, checked once steps are known
        problems.append((f"{stage}.eval_every", f"{every} is more than {stage}.steps ({section['steps']}): "
                         "the stage would evaluate only after training"))
    try:
        held_out_metric(stage, section.get("metric"))
    except KeyError as err:
        problems.append((f"{stage}.metric", str(err.args[0])))
    return problems
