"""Checks of what a config names, made when the plan is built (`snakemake -n` included), before any job waits in a
queue: the files, folders, models and code it points to. The rules between its keys are `posttrain.rules`
(`config_problems`, which the schema's validation calls beside `path_problems` here).

- data: a reasoning-gym task names a generator that exists, with a config it accepts; every row of a local data
  source (up to 64 MiB of files) reads as its kind, or the first bad one is named (file, row, field);
- model and data sources: a local folder or file the config names exists; a hub model id, with
  `HF_HUB_OFFLINE` set, is in the local Hugging Face cache (hub datasets have caches of their own
  and are left to data prep); a bare model name is a preset (or a close one is suggested); a model
  folder (or cached hub id) is of an architecture the model code builds; the tokenizer data prep
  uses has a chat template;
- reward functions (`reward.verifiers`): a `module:function` imports from where the stages look (the working
  directory, the checkout, PYTHONPATH), a `path/file.py:function` file exists relative to the working
  directory and imports, and the function takes (completion, example), or (completions, examples) when
  batched; no function is listed twice; `math` has math-verify installed; `task` scores rows of the built-in
  tasks only, so a `prompts` or `eval` source without a `task` column is refused with it;
- a pretrained reward model (`reward_model.source`: a folder or a cached hub id): its config.json declares a
  sequence classifier with one label, of an architecture the model code builds, and its tokenizer has a chat
  template.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import os
import sys
from collections.abc import Mapping, Sequence
from functools import cache, lru_cache
from pathlib import Path
from types import ModuleType
from typing import Any

from posttrain.data import reasoning_gym
from posttrain.rules import environment_verifier_problem, lm_eval_problem
from posttrain.tokenizer import NAMED_TEMPLATES, folder_chat_template
from posttrain.workflow.did_you_mean import suggest
from posttrain.workflow.inputs import code_search_path
from posttrain.workflow.model_names import backend_problem, hub_file, preset_names

REPO = Path(__file__).resolve().parents[2]  # the checkout, on every stage's PYTHONPATH


@cache
def reward_specs_module() -> ModuleType:
    """`posttrain/rewards/specs.py` loaded as a plain file: the package's `__init__` imports torch, which a dry
    run does not (the stages import the same file as `posttrain.rewards.specs`)."""
    path = REPO / "posttrain" / "rewards" / "specs.py"
    spec = importlib.util.spec_from_file_location("_posttrain_rewards_specs", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


LOCAL_DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")
DRY_RUN_SOURCE_BYTES = 64 << 20  # local sources up to this size are read in the dry run; bigger ones by data prep


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0", "false", "False")


def model_source_problem(source: str, model: bool = True, backend: str = "auto") -> str | None:
    """What is wrong with a model source (`model`; else a tokenizer's): a preset, a local folder, or a hub id.

    A folder (or a hub id in the local cache) must hold a config.json of an architecture `backend`
    (`model.backend`) builds; a bare name is a preset (a close one is suggested) unless the cache knows it as a hub id.
    """
    path = Path(source).expanduser()
    if source in preset_names():
        return None
    if path.exists():
        if not path.is_dir():
            return f"{source}: a model source must be a folder (config.json + *.safetensors)"
        return _architecture_problem(source, path / "config.json", backend) if model else None
    if source.startswith((".", "/", "~")) or source.count("/") > 1:
        return f"{source}: no such folder"
    owner, slash, _ = source.partition("/")
    if slash and Path(owner).is_dir():  # `models/x` beside a `models/` folder: a path, not a hub id
        return f"{source}: no such folder ({owner}/ is a folder here, so this names a path in it, not a hub id)"
    config = hub_file(source, "config.json")
    if "/" not in source and config is None and hub_file(source, "tokenizer.json") is None:
        hint = suggest(source, preset_names()) or f" (presets: {', '.join(preset_names())})"
        return f"{source!r} is not a preset{hint}, a local folder or a hub id (owner/name)"
    if _offline() and config is None and hub_file(source, "tokenizer.json") is None:
        return (f"{source}: HF_HUB_OFFLINE is set and this hub id is not in the local cache; download it where there "
                "is network (`huggingface-cli download`) or name a local folder")
    return _architecture_problem(source, config, backend) if model and config is not None else None


def _architecture_problem(source: str, config: Path, backend: str) -> str | None:
    if not config.is_file():
        return f"{source}: no config.json; a model folder holds config.json and *.safetensors"
    try:
        hf_config = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        hf_config = None
    if not isinstance(hf_config, dict):
        return f"{config}: not a JSON object"
    return backend_problem(hf_config, backend, source)


def chat_template_problem(cfg: Mapping[str, Any]) -> tuple[str, str] | None:
    """Data prep renders every row with the tokenizer's chat template (or `model.chat_template`): a folder without
    one, or a template file that is not there, is refused here."""
    template = cfg["model"]["chat_template"]
    if template:
        if template in NAMED_TEMPLATES or Path(template).expanduser().is_file():
            return None
        return ("model.chat_template", f"{template}: no such file (a Jinja template file, relative to the working "
                f"directory, or one of {', '.join(NAMED_TEMPLATES)})")
    key = "tokenizer" if cfg["model"]["tokenizer"] else "policy"
    source = cfg["model"][key]
    if source in preset_names():
        return None  # data prep trains a BPE tokenizer with a ChatML template for presets
    path = Path(source).expanduser()
    folder = path if path.is_dir() else None
    if folder is None:
        cached = hub_file(source, "tokenizer_config.json")
        folder = cached.parent if cached is not None else None
    if folder is None or folder_chat_template(folder) is not None:
        return None
    return (f"model.{key}", f"{source}: its tokenizer has no chat template (chat_template.jinja, chat_template.json or "
            "tokenizer_config.json's chat_template), which data prep renders every row with; set model.chat_template "
            "(a Jinja file, or chatml) or name a folder whose tokenizer has one in model.tokenizer")


def _signature_problem(spec: Any, value: Any) -> str | None:
    """Whether `value` takes the arguments the stages call it with (per sample, or batched)."""
    call = ("a batched reward function is called as fn(completions: list[str], examples: list[dict]) -> list[float]"
            if spec.batched else "a verifier is called as fn(completion: str, example: dict) -> float")
    try:
        inspect.signature(value).bind(["completion"] if spec.batched else "completion", [{}] if spec.batched else {})
    except TypeError:
        return f"{spec.name}: takes {inspect.signature(value)}; {call}"
    except ValueError:
        pass  # no signature to read (a builtin): the stage's call will tell
    return None


def verifier_problem(entry: str | Mapping[str, Any], search: Sequence[str], workdir: str | None = None) -> str | None:
    """Whether a `reward.verifiers` entry can be called as the stages call it: a built-in (math needs math-verify),
    a `module:function` that imports from where the stages look (`inputs.code_search_path`), or a
    `path/file.py:function` relative to `workdir` (the working directory); the function takes (completion,
    example), or (completions, examples) when batched."""
    specs = reward_specs_module()
    spec = specs.reward_spec(entry)
    if ":" not in spec.name and spec.name not in specs.BUILTIN_VERIFIERS:
        return (f"{spec.name}: not a built-in verifier{suggest(spec.name, specs.BUILTIN_VERIFIERS)}; built-ins: "
                f"{', '.join(specs.BUILTIN_VERIFIERS)}, or "
                "name package.module:function or path/file.py:function")
    if spec.name in specs.BUILTIN_VERIFIERS:
        if spec.batched:
            return f"{spec.name}: a built-in verifier scores one completion at a time; drop batched: true"
        if spec.name == "math" and importlib.util.find_spec("math_verify") is None:
            return "math: the math verifier needs the math-verify package (pip install math-verify==0.9.0)"
        if spec.name == "reasoning_gym" and not reasoning_gym.installed():
            return f"reasoning_gym: the verifier needs reasoning-gym: {reasoning_gym.INSTALL}"
        return None
    module_name, attr = spec.module, spec.attr
    if spec.is_file:
        file = specs.user_module_file(module_name, workdir)
        if not file.is_file():
            return f"{spec.name}: no such file {file} (a reward file's path is relative to the working directory)"
        try:
            value: Any = specs.load_file_module(file)
        except Exception as err:  # the user's file: any error it raises on import is theirs to see
            return f"{spec.name}: cannot import {file} ({type(err).__name__}: {err})"
        where = str(file)
    else:
        before = list(sys.path)
        sys.path[:0] = [p for p in search if p not in sys.path]
        try:
            value = importlib.import_module(module_name)
        except Exception as err:  # the user's module: any error it raises on import is theirs to see
            return (f"{spec.name}: cannot import {module_name!r} ({type(err).__name__}: {err}); modules are looked for "
                    "in the working directory, the checkout and PYTHONPATH")
        finally:
            sys.path[:] = before
        where = f"module {module_name!r} ({getattr(value, '__file__', '?')})"
    for part in attr.split("."):
        if not hasattr(value, part):
            return f"{spec.name}: {where} has no {attr!r}"
        value = getattr(value, part)
    if not callable(value):
        return f"{spec.name}: {attr!r} is not callable"
    return _signature_problem(spec, value)


def _has_task_column(source: Mapping[str, Any]) -> bool:
    """Whether a data source's rows carry a `task` (mapped in `columns`, or a local file's first row has one)."""
    if "task" in (source.get("columns") or {}):
        return True
    path = Path(str(source["path"])).expanduser()
    if not path.is_file():
        return False  # a hub dataset: map its task column in `columns` if it has one
    try:
        if path.suffix == ".parquet":
            import pyarrow.parquet

            return "task" in pyarrow.parquet.read_schema(path).names
        with path.open(encoding="utf-8") as f:
            if path.suffix == ".csv":
                return "task" in f.readline().strip().split(",")
            first = f.readline() if path.suffix == ".jsonl" else f.read()
        row = json.loads(first)
        if isinstance(row, dict) and isinstance(row.get("data"), list):
            row = row["data"]
        if isinstance(row, list):
            row = row[0] if row else {}
        return isinstance(row, dict) and "task" in row
    except (OSError, ValueError, IndexError, AttributeError, TypeError):
        return True  # unreadable here: data prep names the file


def task_verifier_problem(cfg: Mapping[str, Any], names: Sequence[str]) -> tuple[str, str] | None:
    """`task` scores a row by its built-in task (`task` field: arithmetic, sort, reverse); a `prompts` or `eval`
    source whose rows have no task would fail it at the first evaluation or in the reward stage."""
    if "task" not in names:
        return None
    untagged = [s["path"] for s in cfg["data"]["sources"] if s.get("kind") in ("prompts", "eval") and not _has_task_column(s)]
    if not untagged:
        return None
    return (f"reward.verifiers[{list(names).index('task')}]",
            f"task scores rows of the built-in tasks (data.tasks) by their task field, and the rows of "
            f"{', '.join(dict.fromkeys(map(str, untagged)))} have none; use math (it reads GSM8K's '#### 42' "
            "references too), number or a function of your own (or map a task column in the source's columns)")


def reward_model_problem(source: str) -> str | None:
    """What is wrong with a pretrained `reward_model.source`: it must be a folder or a cached hub id whose
    config.json declares a sequence classifier with one label, of a model type the model code builds, with a
    tokenizer that has a chat template (the prompt and completion are rendered with it)."""
    specs = reward_specs_module()
    path = Path(source).expanduser()
    if path.exists():
        if not path.is_dir():
            return f"{source}: a reward model is a folder (config.json, *.safetensors, tokenizer files)"
        config_path, folder = path / "config.json", path
    elif source.startswith((".", "/", "~")) or source.count("/") != 1:
        return f"{source}: no such folder (a pretrained reward model is a folder or a hub id owner/name)"
    else:
        cached = hub_file(source, "config.json")
        if cached is None:
            if _offline():
                return (f"{source}: HF_HUB_OFFLINE is set and this hub id is not in the local cache; download it where "
                        "there is network (`huggingface-cli download`) or name a local folder")
            return None  # downloaded when the stage starts, and checked there
        config_path, folder = cached, cached.parent
    config = specs.read_json_config(config_path)
    if config is None:
        return f"{config_path}: no config.json (a JSON object) in the reward model's folder"
    why = specs.sequence_classifier_problem(config, str(config_path)) or _architecture_problem(source, config_path, "native")
    if why:
        return why
    if not (folder / "tokenizer.json").is_file():
        return f"{source}: no tokenizer.json; the reward model's own tokenizer renders what it scores"
    if folder_chat_template(folder) is None:
        return f"{source}: its tokenizer has no chat template to render a prompt and its completion with"
    return None


def environment_problem(section: Mapping[str, Any]) -> tuple[str, str] | None:
    """`environment.fn` names a built-in or a user class that loads and subclasses `posttrain.envs.Environment`;
    one that runs model-written code needs a machine that can confine it (`posttrain.envs.confinement`)."""
    if not section["fn"]:
        return None
    from posttrain.envs import confinement, load_environment

    try:
        cls = load_environment(section["fn"])
    except (ImportError, TypeError, ValueError, SyntaxError) as err:
        return "environment.fn", str(err)
    allow_missing = section["args"].get("allow_missing", [])
    if not isinstance(allow_missing, list) or not set(allow_missing) <= set(confinement.MECHANISMS):
        return ("environment.args.allow_missing", f"{allow_missing!r}: a list of the sandbox mechanisms it may run "
                f"without ({', '.join(confinement.MECHANISMS)})")
    why = confinement.problem(allow_missing) if cls.SANDBOXED else None
    return ("environment.fn", f"{section['fn']}: {why}") if why else None


def reward_problems(cfg: Mapping[str, Any], search: Sequence[str]) -> list[tuple[str, str]]:
    """(config key, what is wrong) for `reward.verifiers` and a pretrained `reward_model.source`."""
    specs = reward_specs_module()
    problems, names = [], []
    for i, entry in enumerate(cfg["reward"]["verifiers"]):
        name = specs.verifier_name(entry)
        if name in names:
            problems.append((f"reward.verifiers[{i}]", f"{name}: listed twice (also reward.verifiers[{names.index(name)}])"))
        names.append(name)
        why = verifier_problem(entry, search)
        if why:
            problems.append((f"reward.verifiers[{i}]", why))
    task = task_verifier_problem(cfg, names)
    if task:
        problems.append(task)
    if "environment" in names:
        why = environment_verifier_problem(cfg["environment"]["fn"])
        if why:
            problems.append((f"reward.verifiers[{names.index('environment')}]", why))
    source = specs.pretrained_source(cfg["reward_model"]["source"])
    why = reward_model_problem(cfg["reward_model"]["source"]) if source is not None else None
    if why:
        problems.append(("reward_model.source", why))
    return problems


def task_problems(tasks: Sequence[Mapping[str, Any]]) -> list[tuple[str, str]]:
    """A reasoning-gym task names a generator that exists, with a config it accepts (reasoning-gym installed)."""
    problems = []
    for i, task in enumerate(tasks):
        if task.get("name") == "reasoning_gym":
            problem = reasoning_gym.problem(task.get("dataset"), task.get("config", {}))
            if problem:
                problems.append((f"data.tasks[{i}].{problem[0]}", problem[1]))
    return problems


def _local_bytes(path: Path) -> int:
    return path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


@lru_cache(maxsize=256)
def _row_count(source_json: str, index: int, skip_bad: bool, stat: tuple[int, int]) -> int:
    """Rows a source gives after `weight` and `max_rows`, read as data prep reads them (`stat`: the file's size
    and mtime, so an edited file is read again)."""
    from posttrain.data.sources import source_rows

    rows, _ = source_rows(json.loads(source_json), f"data.sources[{index}]", f"{index}", skip_bad=skip_bad)
    return len(rows)


def local_source_rows(data: Mapping[str, Any], index: int) -> int | None:
    """The rows data prep will take from local source `index` (raises DataError on a bad row or an unreadable file);
    None for a hub id, a missing path or one over `DRY_RUN_SOURCE_BYTES` (left to data prep)."""
    source = data["sources"][index]
    local = Path(str(source["path"])).expanduser()
    if not local.exists():
        return None
    size = _local_bytes(local)
    if size > DRY_RUN_SOURCE_BYTES:
        return None
    return _row_count(json.dumps(source, sort_keys=True, default=str), index, data["on_bad_row"] == "skip",
                      (size, local.stat().st_mtime_ns))


def source_row_problems(data: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Every row of a local data source (up to `DRY_RUN_SOURCE_BYTES` of files) read as its kind, as data prep
    reads it: the first bad row (with `on_bad_row: error`) or a file that cannot be read, naming file, row and
    field. Rendering with the chat template (tool calls) needs the tokenizer, and is data prep's check."""
    from posttrain.data.sources import DataError

    problems = []
    for i in range(len(data["sources"])):
        try:
            local_source_rows(data, i)
        except DataError as err:
            problems.append((f"data.sources[{i}]", str(err)))
    return problems


def path_problems(cfg: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(config key, what is wrong) for each model, tokenizer, data source, reward function or reward model that
    cannot be found or used: a missing one, an architecture the model code does not build, a tokenizer without a
    chat template, a reward module or file that does not import or a function with another signature."""
    problems = []
    for key in ("policy", "student", "tokenizer"):
        source = cfg["model"].get(key)
        why = model_source_problem(str(source), model=key != "tokenizer", backend=cfg["model"]["backend"]) if source else None
        if why:
            problems.append((f"model.{key}", why))
    template = chat_template_problem(cfg) if not problems else None
    if template:
        problems.append(template)
    problems += reward_problems(cfg, code_search_path(REPO))
    environment = environment_problem(cfg["environment"])
    if environment:
        problems.append(environment)
    lm_eval = lm_eval_problem(cfg["eval"]["lm_eval_tasks"], cfg["eval"]["lm_eval_optional"])
    if lm_eval:
        problems.append(("eval.lm_eval_tasks", lm_eval))
    for i, spec in enumerate(cfg["data"]["sources"]):
        path = str(spec["path"])
        local = Path(path).expanduser()
        if local.suffix in LOCAL_DATA_SUFFIXES and not local.is_file():
            problems.append((f"data.sources[{i}].path", f"{path}: no such file"))
        elif path.startswith((".", "/", "~")) and not local.exists():  # a file, or a save_to_disk / dataset folder
            problems.append((f"data.sources[{i}].path", f"{path}: no such file or folder"))
    return problems + task_problems(cfg["data"]["tasks"]) + source_row_problems(cfg["data"])
