"""`model.chat_template`: a Jinja file or a named template in place of the tokenizer's own, in data prep and in
every folder after it; the dry run names the key when a template is missing or the file is not there."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers
from eval_fixtures import run_stage

from posttrain.data.store import load_split
from posttrain.tokenizer import CHATML_TEMPLATE, Tokenizer, train_bpe_tokenizer
from posttrain.workflow.inputs import ContentHashes, user_inputs
from posttrain.workflow.schema import ConfigError, load_config

# A template no tokenizer ships: "Q: ... / A: ..." turns, the end of turn the tokenizer's eos.
PLAIN_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'user' %}Q: {{ m['content'] }}\n"
                  "{% elif m['role'] == 'assistant' %}{% generation %}A: {{ m['content'] }}<|im_end|>{% endgeneration %}\n"
                  "{% endif %}{% endfor %}{% if add_generation_prompt %}A: {% endif %}")
ROWS = [{"messages": [{"role": "user", "content": f"add {i} and {i}"}, {"role": "assistant", "content": str(2 * i)}]}
        for i in range(12)]


@pytest.fixture(scope="module")
def bare_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A base model's tokenizer folder with no chat template at all."""
    folder = tmp_path_factory.mktemp("bare-tokenizer")
    train_bpe_tokenizer([json.dumps(r) for r in ROWS] * 5, 300, folder)
    for name in ("chat_template.jinja", "chat_template.json"):
        (folder / name).unlink(missing_ok=True)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config))
    assert Tokenizer(folder).chat_template is None
    return folder


def stage_config(tmp: Path, tokenizer: Path, template: str | None) -> Path:
    data = tmp / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    cfg = load_config(overrides={
        "model": {"tokenizer": str(tokenizer), "chat_template": template},
        "data": {"tasks": [], "sources": [{"kind": "sft", "path": str(data)}], "n_eval": 2, "packing": False},
    })
    cfg.update(stage="prepare_data", key="chat-template", upstream={})
    path = tmp / "config.json"
    path.write_text(json.dumps(cfg))
    return path


def test_a_template_file_renders_every_row_and_travels_with_the_tokenizer(bare_tokenizer, tmp_path, monkeypatch):
    template = tmp_path / "plain.jinja"
    template.write_text(PLAIN_TEMPLATE)
    out = tmp_path / "data"
    run_stage("prepare_data", ["--config", stage_config(tmp_path, bare_tokenizer, str(template)), "--out", out],
              monkeypatch)
    assert (out / "tokenizer" / "chat_template.jinja").read_text() == PLAIN_TEMPLATE
    ours = Tokenizer(out / "tokenizer")
    hf = transformers.AutoTokenizer.from_pretrained(out / "tokenizer")
    messages = ROWS[0]["messages"]
    assert hf.apply_chat_template(messages, tokenize=False) == ours.apply_chat_template(messages, tokenize=False)
    assert hf.apply_chat_template(messages, tokenize=False).startswith("Q: add 0 and 0\nA: 0")
    row = load_split(out, "sft")[0]
    assert ours.decode(row["input_ids"].tolist(), skip_special_tokens=False).startswith("Q: ")


def test_a_named_template_and_the_dry_run_messages(bare_tokenizer, tmp_path, monkeypatch):
    out = tmp_path / "data"
    run_stage("prepare_data", ["--config", stage_config(tmp_path, bare_tokenizer, "chatml"), "--out", out], monkeypatch)
    assert Tokenizer(out / "tokenizer").chat_template == CHATML_TEMPLATE
    with pytest.raises(ConfigError, match=r"model\.chat_template: .*missing\.jinja: no such file"):
        load_config(overrides={"model": {"chat_template": str(tmp_path / "missing.jinja")}})
    with pytest.raises(ConfigError, match=r"model\.tokenizer: .*has no chat template.*set model\.chat_template"):
        load_config(overrides={"model": {"tokenizer": str(bare_tokenizer)}})


def test_the_template_file_is_in_the_data_key(tmp_path):
    template = tmp_path / "plain.jinja"
    template.write_text(PLAIN_TEMPLATE)
    settings = {"model": {"policy": "tiny", "tokenizer": None, "chat_template": str(template)}, "data": {"sources": []}}
    hashes = ContentHashes(tmp_path / "hashes.json")
    first = user_inputs("prepare_data", settings, hashes, ("tiny",), [])["model.chat_template"]
    template.write_text(PLAIN_TEMPLATE.replace("Q: ", "Question: "))
    second = user_inputs("prepare_data", settings, ContentHashes(tmp_path / "hashes2.json"), ("tiny",), [])
    assert second["model.chat_template"] != first
