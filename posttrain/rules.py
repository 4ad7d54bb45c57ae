"""Every rule that relates config keys to each other and to the process layout: one home, torch-free.

The dry run (`config_problems`, called by the schema's validation, from each stage's `resources`) and the
stages (from the processes they were started as) call the same functions, so a layout or a setting is
refused with the same words before a job is queued and, if it slipped past, when it starts. Each returns
what is wrong, or nothing; the caller names the key in its own context and reports or raises. What a
config names on disk or on the hub is checked by `posttrain.workflow.preflight`.

The rules: processes and batch sizes (data-parallel processes, nodes x GPUs or CPU processes over
`parallel.tp x cp`, divide each batch after accumulation; `tp x cp x dp_replicate` divides them; `ep`
divides the FSDP shards and does not combine with `cp`); optimizer-in-backward (no accumulation, no
clipping, GRPO's step one micro-batch); LoRA/QLoRA without tensor parallelism and `save: adapter` on a
base a folder holds; PPO (data parallelism only, a token-level ratio, a trained reward model for
`critic_init: reward_model`); KTO on the offline unpaired split; generator nodes for async GRPO only,
leaving the trainer a node; a trained reward model on a family that has a sequence classifier; the
stage graph (`distill.teacher_stage` before distill, `export.stage` listed, a first stage other than SFT
from a model, not a preset's random weights); evaluation during training (`eval_every`, `keep`,
`early_stopping`) and lm-eval tasks; the `environment` verifier with an environment.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Collection, Mapping, Sequence
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


def reward_model_backend_problem(model_type: str, backend: str) -> str | None:
    """`reward_model.source: train` on GRPO's starting model, of `model_type`, which `backend` runs ("native" or
    "transformers": `model.backend` decided): the reward model is that decoder with a score head, saved as the
    family's `*ForSequenceClassification`. Every native family has one; on the transformers backend, transformers must
    have one for the family (it builds the reward model). transformers is imported only for that backend."""
    if backend != "transformers":
        return None
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES

    if model_type in MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES:
        return None
    return (f"train: the policy's model_type {model_type!r} runs on the transformers backend (model.backend), and "
            "transformers has no sequence classifier (*ForSequenceClassification) for it to build the reward model "
            "on; name a pretrained reward model (a folder or hub id), or set it to null")


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


# --- every rule between the keys of one config: the dry run calls `config_problems` -----------------------------

TRAINING_SECTIONS = ("sft", "dpo", "grpo", "distill")
ADAPTER_SECTIONS = (*TRAINING_SECTIONS, "reward_model")  # the stages with `method`, `lora` and `save`
RESOURCE_SECTIONS = ("data", "sft", "dpo", "reward", "grpo", "distill", "eval", "export")


def config_problems(cfg: Mapping[str, Any], presets: Collection[str],
                    grpo_start: tuple[str, str] | None) -> list[tuple[str, str]]:
    """(config key, what is wrong) of every rule relating keys of a schema-valid config: its values, the stages'
    rules at start, the stage graph (`pipeline`). See `stage_problems` for `presets` and `grpo_start`."""
    return value_problems(cfg) + stage_problems(cfg, presets, grpo_start) + pipeline_problems(cfg, presets)


def value_problems(cfg: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Values that contradict each other: no data, CPU processes beside GPUs, an empty pass-rate band, pass@k
    beyond the samples."""
    problems = []
    if not cfg["data"]["tasks"] and not cfg["data"]["sources"]:
        problems.append(("data.tasks", "is empty and so is data.sources: there is no data"))
    for section in RESOURCE_SECTIONS:
        res = cfg[section]["resources"]
        if res["gpus"] > 0 and res["procs"] > 1:
            problems.append((f"{section}.resources.procs", f"{res['procs']} CPU processes with gpus: {res['gpus']}; "
                             "procs is for CPU runs (gpus: 0), on GPUs one process runs per GPU"))
    low, high = cfg["reward"]["pass_rate_band"]
    if low >= high:
        problems.append(("reward.pass_rate_band", f"[{low}, {high}]: low must be below high"))
    too_big = [k for k in cfg["eval"]["pass_k"] if k > cfg["eval"]["samples"]]
    if too_big:
        problems.append(("eval.pass_k", f"{too_big} exceed eval.samples = {cfg['eval']['samples']}"))
    return problems


def training_processes(resources: Mapping[str, Any]) -> int:
    """Training processes: per node, times the nodes left after the generator nodes."""
    return (int(resources["nodes"]) - int(resources["generator_nodes"])) * int(resources["gpus"] or resources["procs"])


def generator_node_problems(cfg: Mapping[str, Any]) -> list[tuple[str, str]]:
    """`resources.generator_nodes` is async GRPO's, and leaves the trainer at least one node."""
    problems = []
    for section, values in cfg.items():
        nodes = values.get("resources", {}).get("generator_nodes", 0) if isinstance(values, Mapping) else 0
        if not nodes:
            continue
        if section != "grpo" or cfg["grpo"]["mode"] != "async":
            problems.append((f"{section}.resources.generator_nodes", f"{nodes}: only async GRPO (grpo.mode: async) "
                             "runs generators on nodes of their own"))
        elif nodes >= values["resources"]["nodes"]:
            problems.append((f"{section}.resources.generator_nodes", f"{nodes} of {values['resources']['nodes']} "
                             "nodes leaves none to train on: raise grpo.resources.nodes"))
    return problems


def stage_problems(cfg: Mapping[str, Any], presets: Collection[str],
                   grpo_start: tuple[str, str] | None) -> list[tuple[str, str]]:
    """(config key, what is wrong) for each rule a training stage would refuse at start (the rules above, which the
    stages call too, with the processes they were started as). `presets`: the preset model names; `grpo_start`:
    (model_type, the code `model.backend` runs it on) of the model GRPO starts from, where it is known."""
    problems: list[tuple[str, str]] = []
    tp, replicate = int(cfg["parallel"]["tp"]), int(cfg["parallel"]["dp_replicate"])
    cp, ep = int(cfg["parallel"]["cp"]), int(cfg["parallel"]["ep"])
    degrees = parallel_degrees_problem(cp, ep)
    if degrees:
        problems.append(("parallel.ep", degrees))
    in_backward = bool(cfg["memory"]["optimizer_in_backward"])
    problems += generator_node_problems(cfg)
    if cfg["dpo"]["loss"] == "kto" and cfg["dpo"]["pairs"] != "offline":
        problems.append(("dpo.pairs", f"{cfg['dpo']['pairs']}: KTO (dpo.loss: kto) trains on the prepared unpaired "
                         "split; set dpo.pairs: offline"))
    running = [s for s in ADAPTER_SECTIONS if runs(cfg, s)]  # a stage the pipeline leaves out refuses nothing
    for stage in running:
        # the reward model trains as one process: no tensor parallelism
        problems += adapter_problems(stage, cfg[stage]["method"], cfg[stage]["save"],
                                     1 if stage == "reward_model" else tp, starts_from_preset(cfg, stage, presets))
        problems += selection_problems(stage, cfg[stage])
    for stage in (s for s in TRAINING_SECTIONS if s in running):
        section = cfg[stage]
        world = training_processes(section["resources"])
        if world < 1 or degrees:
            continue  # said by generator_node_problems, or above
        layout = parallel_layout_problem(world, tp, cp, replicate, ep)
        if layout:
            problems.append((f"{stage}.resources", f"{world} processes: {layout}"))
            continue
        dp = world // (tp * cp)
        if stage == "grpo" and section["advantage"] == "gae":
            problems += ppo_problems(cfg["parallel"], section["ratio"]) + critic_init_problems(cfg)
        rows = micro = None
        if stage == "grpo":
            prompts, group = section["prompts_per_step"], section["group_size"]
            split = prompt_split_problem(prompts, dp)
            if split:
                problems.append(("grpo.prompts_per_step", split))
            else:
                rows, micro = prompts // dp * group, section["micro_batch_size"]
        else:
            split = batch_split_problem(stage, section["batch_size"], section["grad_accum"], dp)
            if split:
                problems.append((f"{stage}.batch_size", split))
        if in_backward:
            problems += [(f"{stage}.{setting}", why) for setting, why in optimizer_in_backward_problems(
                section.get("grad_accum", 1), section["max_grad_norm"], rows, micro)]
    rm = cfg["reward_model"]
    if rm["source"] == "train" and in_backward:
        problems += [(f"reward_model.{setting}", why) for setting, why in optimizer_in_backward_problems(
            max_grad_norm=rm["max_grad_norm"])]
    if rm["source"] == "train" and grpo_start and (why := reward_model_backend_problem(*grpo_start)):
        problems.append(("reward_model.source", why))
    if cfg["grpo"]["rm_weight"] and rm["source"] is None:
        problems.append(("grpo.rm_weight", f"{cfg['grpo']['rm_weight']}: there is no reward model to weigh; set "
                         "reward_model.source (train, or a pretrained folder or hub id) or grpo.rm_weight: 0"))
    return problems


def runs(cfg: Mapping[str, Any], stage: str) -> bool:
    """Whether the config runs `stage`: a training stage its pipeline names, the reward model when it trains one."""
    if stage == "reward_model":
        return cfg["reward_model"]["source"] == "train"
    return stage in cfg["pipeline"]


def starts_from_preset(cfg: Mapping[str, Any], stage: str, presets: Collection[str]) -> bool:
    """Whether `stage` starts from a preset's random weights: distillation's student, the first stage of `pipeline`
    (the reward model: GRPO's start) from `model.policy`."""
    if stage == "distill":
        return cfg["model"]["student"] in presets
    pipeline = list(cfg["pipeline"])
    at = "grpo" if stage == "reward_model" else stage
    return (at not in pipeline or pipeline.index(at) == 0) and cfg["model"]["policy"] in presets


def critic_init_problems(cfg: Mapping[str, Any]) -> list[tuple[str, str]]:
    """PPO's critic started from the reward model needs one the plan trains (the policy's tokenizer)."""
    grpo, problems = cfg["grpo"], []
    source = cfg["reward_model"]["source"]
    if grpo["critic_init"] == "reward_model" and source is None:
        problems.append(("grpo.critic_init", "reward_model: there is no reward model; set reward_model.source: train "
                         "or critic_init: policy"))
    elif grpo["critic_init"] == "reward_model" and source != "train":
        problems.append(("grpo.critic_init", f"reward_model: the critic values the policy's tokens, and the pretrained "
                         f"reward model {source} has a tokenizer of its own; set critic_init: policy, or "
                         "reward_model.source: train"))
    return problems


def pipeline_problems(cfg: Mapping[str, Any], presets: Collection[str]) -> list[tuple[str, str]]:
    """What the plan cannot build from `pipeline`: a teacher or export stage it does not list, or a stage that
    needs trained weights started from a preset."""
    pipeline, problems = list(cfg["pipeline"]), []
    teacher, exported = cfg["distill"]["teacher_stage"], cfg["export"]["stage"]
    if "distill" in pipeline and teacher and teacher not in pipeline[: pipeline.index("distill")]:
        problems.append(("distill.teacher_stage", f"{teacher} is not listed before distill in pipeline {pipeline}; "
                         "list it there or set null (the stage before distill)"))
    if exported and exported not in pipeline:
        problems.append(("export.stage", f"{exported} is not in pipeline {pipeline}; name one of them or null (the last)"))
    first = pipeline[0]
    from_base = first != "sft" and not (first == "distill" and teacher)
    if from_base and cfg["model"]["policy"] in presets:
        problems.append(("pipeline", f"{pipeline} starts {first} from model.policy {cfg['model']['policy']!r}, a preset "
                         "(random weights); set model.policy to a model folder or hub id, or put sft first"))
    return problems
