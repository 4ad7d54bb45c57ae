"""The scaffold every training stage runs in, written once: a stage script keeps its data, loss, step and evaluation.

    run = StageRun(STAGE, READS, INPUTS, __file__)        # flags, config, processes, mesh, seed, tokenizer,
                                                          # checkpointer, metrics, stop-on-signal
    model = run.build_model(source, hf_config)            # on the mesh, per memory/parallel
    run.epoch_size(rows, per_step)                        # the training split's size: <stage>.epochs -> steps
    optimization = run.optimization(model)                # optimizer, schedule, clipping, guard
    run.resume(model, optimization, data)                 # the newest checkpoint, if any, loaded into them
    before = run.measure_before(evaluate)                 # logged at step 0, kept across a resume
    for step in run.steps():                              # progress, timing, checkpoints, SIGTERM, and
        ...                                               # `evaluate` every <stage>.eval_every steps
        run.log_step(record)                              # (the stage's own step above)
    after = run.final_evaluation()                        # the output model's: last, or best (loaded back)
    run.finish(model, hf_config, summary)                 # final HF folder, provenance, resume state removed

    if __name__ == "__main__":
        run_main(STAGE, main)                             # training.faults: known failures as one line, OOM explained

Resume state lives in `<out>.resume/` (`posttrain.training.checkpointer`): every `<stage>.checkpoint_every`
steps and when SIGTERM arrives (Slurm preemption, time limits; the stage then exits 143 and the
same command continues). A checkpoint holds the model, optimizer, schedule, RNG, the data
position (`data.state_dict()`), the metrics measured before training and the evaluations' selection
state (`posttrain.training.selection`), so a resumed run reports the same "before" numbers on every
rank and keeps and stops where the uninterrupted run does. With `keep: best` the best evaluation's
trainable weights wait in `<out>.resume/best-<step>/` until the output is written.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

from torch import nn
from torch.optim import Optimizer

from posttrain.rules import adapter_problems, batch_split_problem, selection_problems
from posttrain.stage_config import load_stage_config, parse_inputs
from posttrain.model_files import resolve_model_source
from posttrain.models import Transformer, is_preset
from posttrain.parallel import build_mesh, data_parallel_rank, destroy, init_distributed
from posttrain.tokenizer import Tokenizer
from posttrain.training.final_model import save_final_model
from posttrain.training.faults import SettingError, kill_if_requested, pause_if_requested
from posttrain.training.optimization import Optimization
from posttrain.training.checkpointer import Checkpointer, ResumePoint, remove_resume_state
from posttrain.training.selection import Selection
from posttrain.training.signals import StopOnSignal
from posttrain.training.setup import backend_of, build_model, seed_everything
from posttrain.utils.metrics import MetricsLogger, peak_memory_mb, progress_bar, reset_peak_memory, truncate_after
from posttrain.utils.provenance import write_stage_output


class Resumable(Protocol):
    """A data source's position; one that also has `save_files(directory)` / `load_files(directory)` keeps
    files in the checkpoint directory too (written on every rank; read before `load_state_dict`)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class StageRun:
    """One process's share of a training stage run: everything around the stage's own step."""

    def __init__(self, stage: str, reads: tuple[str, ...], inputs: Mapping[str, str], script: str,
                 optional: tuple[str, ...] = (), one_process: bool = False, training: bool = True,
                 section: str | None = None, resumable: bool = True):
        """`one_process`: a stage that runs as one process (no mesh) and refuses to start under several;
        `training` False: a stage that trains nothing (reward scoring, evaluation): no steps, no memory settings;
        `section`: its config section, when not named after the stage (evaluate's `eval`); `resumable` False: a
        stage that keeps no resume state, which SIGTERM ends at once (nothing to save first)."""
        self.started = time.time()
        self.stage, self.one_process = stage, one_process
        self.args = parse_inputs(stage, inputs, optional)
        self.out = Path(self.args.out)
        self.cfg = load_stage_config(self.args.config, reads, script)
        self.section_name = section or stage
        self.section = self.cfg[self.section_name]
        self.memory = self.cfg["memory"] if training else None
        self.total_steps = int(self.section["steps"]) if training else 0
        self.final_step = self.total_steps  # the last step trained: earlier when early stopping ends the loop
        self.eval_every = int(self.section.get("eval_every", 0)) if training else 0
        self._epoch: tuple[int, int] | None = None  # (training rows, rows per step), from `epoch_size`
        if training and self.section.get("epochs") is None:
            self._check_selection()
        self.selection = Selection.of(stage, self.section) if self.eval_every else None
        self.info = init_distributed()
        self.device, self.is_main = self.info.device, self.info.is_main
        if one_process and self.info.world_size > 1:
            raise SettingError(f"{stage} runs as one process, but was started as {self.info.world_size}: "
                               f"set {self.section_name}.resources to one node, at most one GPU and procs 1")
        self.mesh = None if one_process else build_mesh(
            self.info, tp=self.cfg["parallel"]["tp"], dp_replicate=self.cfg["parallel"]["dp_replicate"],
            ep=self.cfg["parallel"]["ep"], cp=self.cfg["parallel"]["cp"])
        self.dp_rank, self.dp_size = data_parallel_rank(self.mesh)
        seed_everything(self.cfg["seed"])
        self.tokenizer = Tokenizer(Path(self.args.data) / "tokenizer")
        # Every piece of run state exists from here on (refusing another run's output before any work):
        # the checkpointer the loop saves through, the metrics it logs to, the signal it stops on.
        self.checkpointer = Checkpointer(self.out, every=self.section.get("checkpoint_every", 0), key=self.cfg["key"])
        self.metrics = MetricsLogger(self.checkpointer.metrics_path, enabled=self.is_main, loggers=self.cfg["loggers"],
                                     run_name=f"{stage}-{self.cfg['key']}", config=self.cfg)
        self.stop = StopOnSignal() if resumable else None
        self.start_step = 0
        self.last_checkpoint: Path | None = None
        self.before: dict[str, Any] = {}
        self.evaluated: dict[int, dict[str, Any]] = {}  # step -> values of the evaluations during training
        self._evaluate: Callable[[], dict[str, Any]] | None = None
        self._resumed: ResumePoint | None = None
        self._record: tuple[dict[str, Any], dict[str, str]] | None = None
        self._policy: dict[str, str] = {}  # model.policy -> its folder, resolved once
        self.backend = "native"  # the trained model's code (`model.backend` decided), in posttrain.json

    # --- setup ---

    def start_model(self, flag: str = "model") -> str:
        """What the stage starts from: the folder given with `--<flag>` (the model of the pipeline's stage
        before it), else `model.policy` (the first stage of `pipeline`): a preset name, or its folder
        (a hub id fetched into the Hugging Face cache)."""
        given = getattr(self.args, flag)
        if given is not None:
            return given
        policy = self.cfg["model"]["policy"]
        if policy not in self._policy:
            self._policy[policy] = policy if is_preset(policy) else str(resolve_model_source(policy))
        return self._policy[policy]

    def build_model(self, source: str | None, hf_config: dict[str, Any], method: str = "full",
                    lora: Mapping[str, Any] | None = None) -> Transformer:
        """The trained model from `source` (a preset, an HF folder or a hub id), on this run's mesh; refuses the
        stage's `method` and `save` where the dry run would (`check_adapters`)."""
        self.check_adapters(method, source)
        self.backend = backend_of(source, hf_config, self.cfg["model"]["backend"])
        return build_model(source, hf_config, self.info, self.mesh, self.cfg, method, lora)

    def check_adapters(self, method: str, source: str | None) -> None:
        """The dry run's rule on `method` and `save` (`rules.adapter_problems`), for the source this run starts from."""
        tp = 1 if self.one_process else int(self.cfg["parallel"]["tp"])
        problems = adapter_problems(self.stage, method, self.section["save"], tp, source is None or is_preset(source))
        if problems:
            raise SettingError("; ".join(f"{key}: {why}" for key, why in problems))

    def frozen_model(self, source: str | None, hf_config: dict[str, Any]) -> Transformer:
        """A model that is only run (teacher, reference): no gradients, eval mode, sharded like the trained one."""
        return build_model(source, hf_config, self.info, self.mesh, self.cfg).requires_grad_(False).eval()

    def micro_batch_size(self) -> int:
        """Global rows per micro-batch (`batch_size / grad_accum`); refuses sizes that do not split evenly."""
        batch, accum = self.section["batch_size"], self.section["grad_accum"]
        problem = batch_split_problem(self.stage, batch, accum, self.dp_size)  # the dry run's rule too
        if problem:
            raise SettingError(f"{self.stage}.batch_size: {problem}")
        return batch // accum

    def _check_selection(self) -> None:
        problems = selection_problems(self.stage, self.section)  # the dry run's rule too
        if problems:
            raise SettingError("; ".join(f"{key}: {why}" for key, why in problems))

    def epoch_size(self, rows: int, per_step: int) -> None:
        """The training split's rows and the rows one step takes: with `<stage>.epochs` set, the run's steps are
        ceil(epochs x rows / per_step) (so the schedule, checkpoints and evaluations follow them); either way the
        summary records the epochs trained."""
        if rows < 1:
            raise SettingError(f"{self.stage}: the training split is empty")
        self._epoch = (rows, per_step)
        epochs = self.section.get("epochs")
        if epochs is not None:
            self.total_steps = self.final_step = max(1, math.ceil(float(epochs) * rows / per_step))
            self.section = {**self.section, "steps": self.total_steps}
            self._check_selection()

    def optimization(self, model: Transformer) -> Optimization:
        if self.section.get("epochs") is not None and self._epoch is None:
            raise RuntimeError(f"{self.stage}: {self.stage}.epochs needs the split's size: call run.epoch_size first")
        return Optimization(model, self.section, self.memory, self.mesh, self.stage, lambda: self.last_checkpoint)

    def resume(self, model: Transformer, optimization: Optimization, data: Resumable,
               extra: Mapping[str, tuple[nn.Module, Optimizer]] | None = None) -> ResumePoint | None:
        """Load the newest checkpoint into model, optimizer, schedule, RNG and `data` (and `extra`'s
        models and optimizers, trained beside the main one: PPO's critic), which the loop's checkpoints then save."""
        self._model, self._optimization, self._data, self._extra = model, optimization, data, extra
        resumed = self.checkpointer.load(model, optimization.optimizer, optimization.scheduler, extra)
        if resumed is not None:
            if hasattr(data, "load_files"):
                data.load_files(resumed.path)
            data.load_state_dict(resumed.data_state["data"])
            self.before = resumed.data_state["before"]
            if self.selection is not None:
                self.selection.load_state_dict(resumed.data_state["selection"])
                self.evaluated = {int(k): v for k, v in resumed.data_state["evaluated"].items()}
                self.checkpointer.prune_best(self.selection.best_step)  # any newer best came after this checkpoint
            self.start_step, self.last_checkpoint = resumed.step, resumed.path
            if self.is_main:
                truncate_after(self.checkpointer.metrics_path, self.start_step)
                print(f"resuming from {resumed.path} at step {self.start_step}", flush=True)
        elif self.selection is not None:
            self.checkpointer.prune_best(None)  # a killed run's bests from before its first checkpoint
        self._resumed = resumed
        return resumed

    def measure_before(self, measure: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """What the starting model scores: measured and logged at step 0 on a fresh start, restored on resume.
        `measure` is the stage's held-out evaluation, run again every `eval_every` steps and at the end."""
        self._evaluate = measure
        if self._resumed is None:
            self.before = measure()
            if self.before:
                self.log(0, self.before)
        return self.before

    # --- the loop ---

    def steps(self) -> Iterator[int]:
        """Steps `start + 1 .. steps`; after each: metrics, progress, periodic checkpoint, stop on SIGTERM."""
        bar = progress_bar(self.total_steps, self.start_step, self.is_main, self.stage)
        for step in range(self.start_step + 1, self.total_steps + 1):
            self._t0 = time.perf_counter()
            reset_peak_memory(self.device)
            self._record = None
            yield step
            if self._record is None:
                raise RuntimeError(f"{self.stage}: step {step} ended without run.log_step")
            record, postfix = self._record
            self.metrics.log(step, record)
            bar.update(1)
            bar.set_postfix({k: f"{record[k]:{fmt}}" for k, fmt in postfix.items()}, refresh=False)
            if self.is_main and step % self.section["log_every"] == 0:
                bar.write(f"step {step}/{self.total_steps} " + json.dumps(
                    {k: round(v, 6) if isinstance(v, float) else v for k, v in record.items()}))
            if self.selection is not None and (step % self.eval_every == 0 or step == self.total_steps):
                self._evaluate_during(step)
            stopping = self.selection is not None and self.selection.should_stop() and step < self.total_steps
            due = self.checkpointer.due(step, self.total_steps) and not stopping
            if due:
                self._save(step)
            if stopping:
                bar.write(f"{self.stage}: early stopping at step {step}: {self.selection.metric} has not improved on "
                          f"step {self.selection.best_step}'s {self.selection.best:.6g} for {self.selection.since_best} "
                          "evaluations")
                self.final_step = step
                break
            pause_if_requested(self.stage, step, self.stop)
            if step < self.total_steps and self.stop.requested():
                if not due:
                    self._save(step)
                bar.close()
                self.metrics.close()
                self.stop.exit(step, self.last_checkpoint)
            kill_if_requested(step)
        bar.close()

    def _evaluate_during(self, step: int) -> None:
        """The held-out evaluation after `step`, logged; with `keep: best`, a new best's weights saved aside."""
        if self._evaluate is None:
            raise RuntimeError(f"{self.stage}: eval_every is set but the stage gave run.measure_before no evaluation")
        values = self._evaluate()
        self.log(step, values)
        self.evaluated[step] = values
        if self.selection.update(step, values) and self.section.get("keep") == "best":
            self.checkpointer.save_best(step, self._model)

    def _save(self, step: int) -> None:
        state = {"data": self._data.state_dict(), "before": self.before}
        if self.selection is not None:
            state.update(selection=self.selection.state_dict(), evaluated=self.evaluated)
        self.last_checkpoint = self.checkpointer.save(
            step, self._model, self._optimization.optimizer, self._optimization.scheduler, state, self._extra,
            write_files=getattr(self._data, "save_files", None))
        if self.selection is not None:
            self.checkpointer.prune_best(self.selection.best_step)

    def seconds(self) -> float:
        """Seconds since the current step began."""
        return time.perf_counter() - self._t0

    def log_step(self, record: dict[str, Any], postfix: Mapping[str, str] | None = None,
                 tokens: float | None = None) -> None:
        """The step's metrics (`step_s` and `peak_memory_mb` added, and `tokens_per_s` of the step's `tokens`);
        `postfix`: metric -> format for the bar."""
        if tokens is not None:
            record["tokens_per_s"] = tokens / self.seconds()
        record.setdefault("step_s", self.seconds())
        record["peak_memory_mb"] = peak_memory_mb(self.device)
        self._record = (record, dict(postfix or {"loss": ".4f"}))

    def log(self, step: int, values: dict[str, Any]) -> None:
        self.metrics.log(step, values)

    # --- the end ---

    def final_evaluation(self) -> dict[str, Any]:
        """The held-out evaluation of the model this stage outputs: with `keep: best`, the best evaluation's
        weights are loaded back into the model and its values returned; else the last step's, measured once."""
        if self._evaluate is None:
            raise RuntimeError(f"{self.stage}: final_evaluation needs the evaluation given to run.measure_before")
        if self.selection is not None and self.section.get("keep") == "best":
            self.checkpointer.load_best(self.selection.best_step, self._model)
            return self.evaluated[self.selection.best_step]
        if self.final_step not in self.evaluated:
            self.evaluated[self.final_step] = self._evaluate()
            self.log(self.final_step, self.evaluated[self.final_step])
        return self.evaluated[self.final_step]

    def selection_summary(self) -> dict[str, Any]:
        """What the summary records of evaluation during training: the steps trained, the best and what was kept."""
        trained = {"steps": self.final_step}
        if self._epoch is not None:
            rows, per_step = self._epoch
            trained.update(epochs=round(self.final_step * per_step / rows, 4), train_rows=rows)
        if self.selection is None:
            return trained
        return {**trained, "stopped_early": self.final_step < self.total_steps,
                "keep": self.section.get("keep", "last"), "evaluations": len(self.evaluated), **self.selection.summary()}

    def finish(self, model: Transformer, hf_config: dict[str, Any], summary: dict[str, Any], base_model: str | None) -> None:
        """Write the final HF folder (`base_model`: the adapters' base; what LoRA writes by the stage's `save`), drop
        the resume state, leave the process group."""
        self.metrics.close()
        summary = {**summary, **self.selection_summary()} if self.memory is not None else summary
        summary = {**summary, "model_backend": self.backend}
        save_final_model(
            self.out, model, hf_config=hf_config, tokenizer=self.tokenizer, cfg=self.cfg, started=self.started,
            summary=summary, metrics_path=self.checkpointer.metrics_path, is_main=self.is_main, base_model=base_model,
            save=self.section["save"],
        )
        self.done()
        if self.is_main:
            print(json.dumps({"out": str(self.out), **summary}), flush=True)
        destroy()

    def write_output(self, write: Callable[[Path], Mapping[str, Any]]) -> None:
        """The output of a stage that writes no model: `write` fills a temporary folder and returns the summary its
        provenance records; the folder takes the output's name only when complete (with its manifest), and the
        resume state goes."""
        write_stage_output(self.out, self.cfg, self.stage, self.started, write)
        self.done()

    def done(self) -> None:
        """The output is complete: remove the resume state and give SIGTERM back its previous handler."""
        remove_resume_state(self.checkpointer.root)
        if self.stop is not None:
            self.stop.restore()
