"""What a stage key covers: declared reads (and the guard on them), run settings, the code fingerprint.

The last test plans a copy of the real repository in a faked finished smoke state (every planned
output folder present, no stage run): `snakemake -n` then shows which edits of a loss module move
which stages to new keys, and says why.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pytest

from posttrain.stage_config import StageConfig, UndeclaredConfigKeyError, load_stage_config
from posttrain.workflow.schema import get_dotted, load_config
from posttrain.workflow.fingerprint import StageSourceError, declared_reads, fingerprint, module_hashes
from posttrain.workflow.layout import STAGE_DIRS
from posttrain.workflow.plan import build_plan
from snakemake_testing import copy_repo, job_counts

REPO = Path(__file__).resolve().parents[2]
KEY = "[0-9a-f]{12}"


def write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip("\n"))


# --- code fingerprint -------------------------------------------------------------------------

LIBRARY = {
    "posttrain/__init__.py": '"""The package."""\n',
    "posttrain/a/__init__.py": "from posttrain.a.m import double\n",
    "posttrain/a/m.py": '''
        """m: doubles."""

        def double(x):
            """Twice x."""
            from posttrain.a.n import factor  # a function-local import counts

            return factor() * x  # the loss
    ''',
    "posttrain/a/n.py": "def factor():\n    return 2\n",
    "posttrain/a/unused.py": "def never():\n    return 0\n",
    "posttrain/b.py": "VALUE = 1\n",
    "stages/s.py": '''
        """s: a stage."""
        import json

        import posttrain.b
        from posttrain.a import m

        READS = ("seed", "s")
    ''',
}


@pytest.fixture
def lib(tmp_path: Path) -> Path:
    write(tmp_path, LIBRARY)
    return tmp_path


def hashes(root: Path) -> dict[str, str]:
    return module_hashes(root / "stages" / "s.py", root)


def test_fingerprint_covers_the_script_and_its_posttrain_imports_transitively(lib):
    assert set(hashes(lib)) == {"stages/s.py", "posttrain/__init__.py", "posttrain/b.py",
                                "posttrain/a/__init__.py", "posttrain/a/m.py", "posttrain/a/n.py"}


@pytest.mark.parametrize("edit", [
    lambda text: text.replace("# the loss", "# the loss, now with a longer comment"),
    lambda text: text.replace('"""Twice x."""', '"""Twice x, said differently."""'),
    lambda text: text.replace('"""m: doubles."""\n', ""),
    lambda text: text.replace("factor() * x", "factor()*x").replace("def double(x):", "def double( x ):\n"),
])
def test_comments_docstrings_and_formatting_leave_the_fingerprint_alone(lib, edit):
    before = hashes(lib)
    path = lib / "posttrain/a/m.py"
    path.write_text(edit(path.read_text()))
    assert hashes(lib) == before


@pytest.mark.parametrize("module", ["posttrain/a/m.py", "posttrain/a/n.py", "posttrain/a/__init__.py", "posttrain/b.py"])
def test_a_real_edit_of_any_imported_module_changes_its_hash_only(lib, module):
    before = hashes(lib)
    with open(lib / module, "a") as f:
        f.write("EXTRA = 3\n")
    after = hashes(lib)
    assert {name for name in after if after[name] != before[name]} == {module}
    assert fingerprint(after) != fingerprint(before)


def test_an_unimported_module_and_other_packages_do_not_count(lib):
    before = hashes(lib)
    (lib / "posttrain/a/unused.py").write_text("def never():\n    return 1\n")
    assert hashes(lib) == before and not any(name.startswith("json") for name in before)


def test_an_import_of_a_missing_posttrain_module_names_the_file_and_line(lib):
    (lib / "posttrain/b.py").write_text("VALUE = 1\nimport posttrain.nowhere\n")
    with pytest.raises(StageSourceError, match=r"posttrain/b.py:2: imports posttrain.nowhere, which is not a module"):
        hashes(lib)


@pytest.mark.parametrize(("line", "message"), [
    ("", r"s.py: no module-level READS = \(...\)"),
    ("READS = tuple(['seed'])", r"s.py:\d+: READS must be a tuple of string literals"),
    ("READS = ['seed']", r"s.py:\d+: READS must be a tuple of dotted config keys"),
    ("READS = ('seed', 'Sft lr')", r"s.py:\d+: READS must be a tuple of dotted config keys"),
])
def test_reads_must_be_a_literal_tuple_of_dotted_keys(tmp_path, line, message):
    script = tmp_path / "s.py"
    script.write_text(f'"""s."""\n{line}\n')
    with pytest.raises(StageSourceError, match=message):
        declared_reads(script)


def test_every_stage_declares_config_keys_that_exist():
    cfg = load_config()
    for stage in (*STAGE_DIRS, "report"):
        reads = declared_reads(REPO / "stages" / f"{stage}.py")
        assert reads, stage
        if stage != "report":  # the report reads the plan's manifests, not the config
            for key in reads:
                get_dotted(cfg, key)  # KeyError when the config has no such key


def test_a_declared_run_setting_stops_the_plan(tmp_path):
    repo = tmp_path / "repo"
    shutil.copytree(REPO / "stages", repo / "stages")
    shutil.copytree(REPO / "posttrain", repo / "posttrain", ignore=shutil.ignore_patterns("__pycache__"))
    script = repo / "stages" / "export.py"
    script.write_text(script.read_text().replace('READS = ("model.backend", "export")', 'READS = ("model.backend", "export", "loggers")'))
    with pytest.raises(ValueError, match=r"export.py: READS declares the run setting\(s\) loggers"):
        build_plan(load_config(), repo=repo)


# --- the guard on a stage's reads -------------------------------------------------------------

RESOLVED = {"stage": "dpo", "key": "k", "upstream": {"sft": "s"}, "code": {"fingerprint": "f", "modules": {}},
            "seed": 1, "model": {"dtype": "float32", "policy": "tiny"}, "sft": {"lr": 0.1},
            "dpo": {"beta": 0.1, "lora": {"rank": 8}}, "data": {"max_seq_len": 60, "n_sft": 9}}
READS = ("seed", "model.dtype", "data.max_seq_len", "dpo")


def guarded(data=RESOLVED) -> StageConfig:
    return StageConfig(data, READS, "stages/dpo.py")


def test_declared_keys_their_subtrees_and_workflow_keys_read_through():
    cfg = guarded({**RESOLVED, "loggers": ["tensorboard"], "dpo": {**RESOLVED["dpo"], "log_every": 5}})
    assert cfg["seed"] == 1 and cfg["model"]["dtype"] == "float32" and cfg["dpo"]["lora"]["rank"] == 8
    assert cfg["key"] == "k" and cfg["upstream"] == {"sft": "s"} and cfg["code"]["fingerprint"] == "f"
    assert cfg["loggers"] == ["tensorboard"] and cfg["dpo"]["log_every"] == 5  # run settings
    assert cfg["dpo"].get("missing", 3) == 3  # a declared section: absent keys may default
    assert sorted(cfg) == ["code", "data", "dpo", "key", "loggers", "model", "seed", "stage", "upstream"]
    assert dict(cfg["model"]) == {"dtype": "float32"} and dict(cfg["data"]) == {"max_seq_len": 60}


@pytest.mark.parametrize(("read", "dotted"), [
    (lambda cfg: cfg["sft"]["lr"], "sft.lr"),  # an upstream stage's setting, present for provenance
    (lambda cfg: cfg["model"]["policy"], "model.policy"),
    (lambda cfg: cfg["data"].get("n_sft", 0), "data.n_sft"),  # .get does not hide it
    (lambda cfg: cfg.get("reward", {}), "reward"),
])
def test_an_undeclared_read_names_the_stage_the_key_and_the_script(read, dotted):
    with pytest.raises(UndeclaredConfigKeyError) as err:
        read(guarded())
    assert str(err.value).startswith(f"stage 'dpo' reads config key {dotted!r}, which stages/dpo.py does not declare in READS")


def test_run_settings_come_from_the_run_file_next_to_the_config(tmp_path):
    (tmp_path / "k.config.json").write_text(json.dumps(RESOLVED))
    (tmp_path / "k.run.json").write_text(json.dumps({"loggers": ["tensorboard"], "dpo": {"checkpoint_every": 4}}))
    cfg = load_stage_config(tmp_path / "k.config.json", READS, "stages/dpo.py")
    assert cfg["loggers"] == ["tensorboard"] and cfg["dpo"]["checkpoint_every"] == 4 and cfg["dpo"]["beta"] == 0.1
    assert cfg.resolved["sft"] == {"lr": 0.1}  # the whole merged config, for provenance
    (tmp_path / "k.run.json").unlink()
    with pytest.raises(KeyError, match="config key 'loggers' is missing from .*k.config.json"):
        load_stage_config(tmp_path / "k.config.json", READS, "stages/dpo.py")["loggers"]


# --- a copy of the repository in a finished smoke state ---------------------------------------

COPIED = ("Snakefile", "workflow", "config", "stages", "posttrain", "envs")
EDITED = "posttrain/losses/grpo.py"  # imported by the GRPO stage only (posttrain/losses/__init__.py re-exports nothing)


class Copy:
    def __init__(self, root: Path):
        self.root = root
        root.mkdir()
        copy_repo(root, COPIED)
        self.results = root / "results" / "smoke"

    def dry_run(self) -> tuple[Counter, str]:
        env = {**os.environ, "PYTHONPATH": str(self.root)}
        proc = subprocess.run([sys.executable, "-m", "snakemake", "--configfile", "config/smoke.yaml", "--dry-run",
                               "--cores", "1"], cwd=self.root, env=env, capture_output=True, text=True, timeout=300)
        output = proc.stdout + proc.stderr
        assert proc.returncode == 0, output[-4000:]
        return job_counts(output), output

    def finish(self) -> None:
        """Every planned output folder, created after the configs and in pipeline order (Snakemake
        compares modification times), as if the pipeline had run."""
        for stage_dir in STAGE_DIRS.values():
            for config in sorted((self.results / stage_dir).glob("*.config.json")):
                config.with_name(config.name.removesuffix(".config.json")).mkdir()
        (self.results / "report").mkdir()
        (self.results / "variants" / "default").mkdir(parents=True)

    def configs(self, stage: str) -> dict[str, dict]:
        return {p.name.removesuffix(".config.json"): json.loads(p.read_text())
                for p in (self.results / STAGE_DIRS[stage]).glob("*.config.json")}


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Copy:
    repo = Copy(tmp_path_factory.mktemp("copy") / "repo")
    repo.dry_run()  # writes every planned config
    repo.finish()
    assert repo.dry_run()[0] == Counter()
    return repo


def test_comment_and_docstring_edits_of_a_loss_plan_nothing(finished):
    path = finished.root / EDITED
    original = path.read_text()
    try:
        path.write_text(original.replace('"""', '"""Edited docstring. ', 1) + "\n# a comment at the end\n")
        assert path.read_text() != original
        assert finished.dry_run()[0] == Counter()
    finally:
        path.write_text(original)


def test_a_loss_edit_reruns_exactly_its_importers_and_downstream_under_new_keys(finished):
    importers = {stage for stage in STAGE_DIRS
                 if any(EDITED in cfg["code"]["modules"] for cfg in finished.configs(stage).values())}
    assert importers == {"grpo"}
    (old_grpo,) = finished.configs("grpo")
    path = finished.root / EDITED
    original = path.read_text()
    try:
        path.write_text(original + "\nUNUSED_CONSTANT = 1\n")
        counts, output = finished.dry_run()
    finally:
        path.write_text(original)
    # GRPO, distillation (its teacher is GRPO), their evals, the export of the distilled model, the
    # report and the variant view; not data, SFT, DPO, reward nor the SFT and DPO evals.
    assert counts == Counter({"grpo": 1, "distill": 1, "evaluate": 2, "export": 1, "report": 1, "variant": 1, "all": 1})
    new_outputs = re.findall(rf"output: \S*?/(\w+)/({KEY})\b", output)
    assert {d for d, _ in new_outputs} == {"grpo", "distill", "eval", "export"}
    assert all(not (finished.results / d / key).exists() for d, key in new_outputs)  # new keys; old outputs stay
    grpo_line = rf"^rerun reason: grpo ({KEY}) \(was {old_grpo}\): code: {EDITED}$"
    assert re.search(grpo_line, output, re.M), output[-3000:]
    assert re.search(rf"^rerun reason: distill {KEY} \(was {KEY}\): input: new key of grpo$", output, re.M)
    assert len(re.findall(r"^rerun reason: evaluate .*: input: new key of (grpo|distill)$", output, re.M)) == 2
