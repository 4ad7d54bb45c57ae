"""What a page shows can never be refused: every YAML block and every `snakemake` command line of README.md and
docs/*.md, read from the pages themselves, goes through the validator the Snakefile runs.

A YAML block is an overlay on config/config.yaml (as a user's `--configfile`). Each passes the schema; those that
name only files this checkout ships (or none) go through all of `workflow/common.smk`'s work: the `--config`
typing, the cross-key rules and the files they read, and the plan. Each `snakemake` command line does too, with its
own `--configfile` and `--config` arguments parsed by Snakemake's own parser. Generated tables name the tree they
came from; a table made from uncommitted changes cannot be rerun from any commit, so its footer is refused."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml
from snakemake.cli import parse_config

from posttrain.workflow.overrides import apply_command_line
from posttrain.workflow.plan import build_plan
from posttrain.workflow.schema import DEFAULT_CONFIG, load_schema, load_yaml, merge, schema_problems, validate_config

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SCHEMA = load_schema()
FILE_SUFFIXES = (".py", ".jsonl", ".json", ".parquet", ".yaml", ".yml", ".tsv", ".csv", ".txt")
# Tables generated from uncommitted trees before this test existed; each leaves the list when it is regenerated.
DIRTY_BEFORE_THIS_TEST = {("README.md", "1fddc204241a"), ("docs/environments.md", "81a9f95b12e3"),
                          ("docs/environments.md", "5d46887322e1"), ("docs/smollm2.md", "1fddc204241a"),
                          ("docs/smollm2.md", "4c9c42a7f1a6")}


def _where(page: Path, text: str, index: int) -> str:
    return f"{page.relative_to(REPO)}:{text.count(chr(10), 0, index) + 1}"


def yaml_blocks() -> list[tuple[str, str]]:
    """(page:line, block) of every ```yaml block."""
    blocks = []
    for page in PAGES:
        text = page.read_text()
        blocks += [(_where(page, text, m.start()), m.group(1)) for m in re.finditer(r"```yaml\n(.*?)```", text, re.S)]
    return blocks


def snakemake_commands() -> list[tuple[str, list[str]]]:
    """(page:line, argv) of every `snakemake` command line that sets the config (`--configfile` or `--config`)."""
    commands = []
    for page in PAGES:
        text = page.read_text()
        for m in re.finditer(r"^[ \t]*(snakemake [^\n`]*--config[^\n`]*)", text, re.M):
            words = shlex.split(m.group(1).split("#")[0])
            commands.append((_where(page, text, m.start()), words))
    return commands


def _strings(value) -> list[str]:
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return [value] if isinstance(value, str) else []


def names_only_shipped_files(overlay: dict) -> bool:
    """Every path-like string of the overlay is a file or folder of this checkout (a hub id is not)."""
    paths = [s for s in _strings(overlay) if "/" in s or s.endswith(FILE_SUFFIXES)]
    return all((REPO / s.split(":")[0]).exists() for s in paths)


def dry_run_checks(files: list[Path], overlay: dict, command_line: dict) -> dict:
    """What workflow/common.smk does before Snakemake builds its DAG: the same calls, in the same order."""
    cfg = merge(*(load_yaml(f) for f in files), overlay)
    checked = validate_config(apply_command_line(cfg, command_line, SCHEMA), where="docs example", schema=SCHEMA)
    build_plan(checked, repo=REPO)
    return checked


BLOCKS = yaml_blocks()
COMMANDS = snakemake_commands()


def test_the_pages_hold_examples_to_check():
    assert len(BLOCKS) >= 8 and len(COMMANDS) >= 15, (len(BLOCKS), len(COMMANDS))


@pytest.mark.parametrize("where,block", BLOCKS, ids=[w for w, _ in BLOCKS])
def test_every_yaml_block_is_a_config_the_validator_accepts(where, block, monkeypatch):
    monkeypatch.chdir(REPO)  # relative paths are the checkout's, as for a user running snakemake in it
    overlay = yaml.safe_load(block)
    assert isinstance(overlay, dict), where
    base = load_yaml(DEFAULT_CONFIG)
    assert schema_problems(merge(base, overlay), SCHEMA) == [], where
    if names_only_shipped_files(overlay):
        dry_run_checks([DEFAULT_CONFIG], overlay, {})


@pytest.mark.parametrize("where,argv", COMMANDS, ids=[w for w, _ in COMMANDS])
def test_every_snakemake_command_line_is_a_config_the_dry_run_accepts(where, argv, monkeypatch):
    monkeypatch.chdir(REPO)
    files, entries, option = [DEFAULT_CONFIG], [], None
    for word in argv[1:]:
        if word.startswith("-"):
            option = word
        elif option == "--configfile":
            files.append(REPO / word)
        elif option == "--config":
            entries.append(word)
    cfg = dry_run_checks(files, {}, parse_config(entries))
    assert cfg["results"], where


def test_no_generated_table_names_an_uncommitted_tree():
    dirty = set()
    for page in PAGES:
        for sha in re.findall(r"commit ([0-9a-f]{7,40})-dirty", page.read_text()):
            dirty.add((str(page.relative_to(REPO)), sha[:12]))
    assert dirty <= DIRTY_BEFORE_THIS_TEST, f"tables made from uncommitted changes: {sorted(dirty - DIRTY_BEFORE_THIS_TEST)}"


def test_the_checks_refuse_what_a_page_must_not_show():
    """The same two checks on examples that are wrong: a misspelt key (the schema) and a verifier that is not a
    built-in (the dry run's rule), so a page showing either would fail the tests above."""
    assert [p.key for p in schema_problems(merge(load_yaml(DEFAULT_CONFIG), {"sft": {"lrr": 1e-3}}), SCHEMA)] == ["sft.lrr"]
    with pytest.raises(Exception, match="reward.verifiers.0.: taks: not a built-in verifier .did you mean 'task'"):
        dry_run_checks([DEFAULT_CONFIG], {"reward": {"verifiers": ["taks"]}}, {})
