"""The dataset shapes users bring, prepared by the prepare_data stage and checked token for token.

Each fixture under tests/fixtures/datasets/ holds a few hand-written rows in the exact shape of a
public dataset (UltraFeedback-binarized, TRL's implicit-prompt preference, ShareGPT, OpenAI tool
calls, KTO with renamed columns, Anthropic HH-RLHF, TRL's standard formats), plus a
`save_to_disk` folder and a hub-layout folder. The tests prepare them with a tokenizer whose chat
template renders tools (tool_chat_template.jinja) and compare the ids and the trained tokens with
`transformers.apply_chat_template` on the conversation each row means: no turn twice, the
completion starting at the right token, loss on the assistant part only. Then every malformed
variant is refused in one line naming file, row and field, leaving nothing under the output name.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import transformers
import yaml
from eval_fixtures import run_stage

from posttrain.data.chat import IGNORE_INDEX
from posttrain.data.sources import COLUMN_FIELDS, KINDS, RENDERS, SOURCE_KEYS, canonical_rows, load_source, mix, source_rows
from posttrain.data.store import load_split
from posttrain.tokenizer import IM_END, Tokenizer, train_bpe_tokenizer
from posttrain.workflow.schema import load_schema, validate_config

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "datasets"
MAX_LEN = 512

# What a `datasets.save_to_disk` folder holds (a DatasetDict): the source reads its `test` split.
SAVED = {
    "train": [{"messages": [{"role": "user", "content": "Never read: train split."},
                            {"role": "assistant", "content": "Not this."}]}],
    "test": [{"messages": [{"role": "user", "content": "Count to three."}, {"role": "assistant", "content": "1, 2, 3"}]},
             {"messages": [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "Teal."}]}],
}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
NUMBER_TOOLS = [{"type": "function", "function": {"name": name, "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}} for name in ("add", "multiply")]


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


def call(call_id: str, name: str, arguments: dict) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


# The conversation each SFT row means, in split order: (messages, tools[, first trained message]); or plain
# text (prompt, completion).
SFT_EXPECTED: list[tuple[Any, ...]] = [
    # sharegpt.jsonl: from/value, human -> user, gpt -> assistant, the system turn kept
    ([{"role": "system", "content": "You are a terse assistant."}, user("Name a prime number."), assistant("7")], None),
    ([user("Say hello in French."), assistant("Bonjour."), user("And in Spanish?"), assistant("Hola.")], None),
    # openai_tool_calls.jsonl: content null with tool_calls (arguments parsed from JSON), tool results, reasoning
    ([user("What is the weather in Paris?"),
      {"role": "assistant", "content": None, "tool_calls": [call("call_1", "get_weather", {"city": "Paris"})]},
      {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature_c": 18, "sky": "cloudy"}'},
      {"role": "assistant", "content": "It is 18 C and cloudy in Paris.", "reasoning_content": "The tool reports 18 C with clouds."}],
     [WEATHER_TOOL]),
    ([user("Add 2 and 3, then multiply 4 by 5."),
      {"role": "assistant", "content": "Calling both tools.",
       "tool_calls": [call("call_a", "add", {"a": 2, "b": 3}), call("call_b", "multiply", {"a": 4, "b": 5})]},
      {"role": "tool", "tool_call_id": "call_a", "content": "5"}, {"role": "tool", "tool_call_id": "call_b", "content": "20"},
      assistant("2 + 3 = 5 and 4 * 5 = 20.")], NUMBER_TOOLS),
    # the save_to_disk folder, split test
    *[(row["messages"], None) for row in SAVED["test"]],
    # hub_folder/ (train.jsonl, test.jsonl), split test: conversational prompt-completion; a prompt's own
    # assistant turn is context, not trained (TRL's completion-only loss)
    ([user("Translate 'house' to German."), assistant("Haus")], None),
    ([user("Translate 'tree' to German."), assistant("Baum"), user("And 'trees'?"), assistant("Baeume")], None, 3),
    # lm_text.jsonl, split train[1:]: standard language modeling, every token trained
    ("", "Rivers run to the sea, and the sea is never full."),
    # prompt_completion_standard.jsonl, render: raw: TRL's standard prompt-completion
    ("The capital of France is", " Paris."),
    ("Two plus two equals", " four."),
]
# Each preference row: (prompt, chosen, rejected) as messages, or as plain text (render: raw).
PREFERENCE_EXPECTED: list[tuple[Any, Any, Any]] = [
    # ultrafeedback_binarized.jsonl: the prompt given, and again at the head of chosen/rejected: once
    ([user("Which planet is known as the red planet?")], [assistant("Mars, for the iron oxide on its surface.")],
     [assistant("Jupiter.")]),
    ([user("Write a haiku about rain.")], [assistant("Soft rain on the roof\nthe garden drinks in silence\nclouds drift to the east")],
     [assistant("Rain is wet.")]),
    # trl_implicit_prompt.jsonl: no prompt column; the common head of chosen and rejected is the prompt
    ([user("What color is the sky?")], [assistant("It is blue.")], [assistant("It is green.")]),
    ([{"role": "system", "content": "Answer with one number."}, user("What is 2 + 2?"), assistant("4"), user("And 3 + 3?")],
     [assistant("6")], [assistant("33")]),
    # hh_rlhf.jsonl: "\n\nHuman: ...\n\nAssistant: ..." text pairs, as the conversation they spell
    ([user("How do I boil an egg?")], [assistant("Put it in boiling water for about nine minutes, then cool it in cold water.")],
     [assistant("Eggs cannot be boiled.")]),
    ([user("Hi there."), assistant("Hello! How can I help?"), user("Recommend a book about space.")],
     [assistant("Cosmos by Carl Sagan.")], [assistant("I do not read.")]),
    # preference_standard_implicit.jsonl, render: raw: TRL's standard implicit prompt (common text prefix)
    ("The sky is", " blue.", " green."),
    ("Water boils at", " 100 degrees.", " 50 degrees."),
]
# kto_renamed.jsonl through `columns`: (prompt, completion, desirable)
UNPAIRED_EXPECTED = [
    ([user("Is 9 a prime number?")], [assistant("No, 9 = 3 x 3.")], True),
    ([user("Is 9 a prime number?")], [assistant("Yes.")], False),
    ([user("Spell cat backwards.")], [assistant("tac")], True),
]
PROMPTS_EXPECTED = [  # prompt_only.jsonl: conversational prompt-only
    [{"role": "system", "content": "Answer with a number."}, user("How many legs does a spider have?")],
    [user("How many days are in a week?")],
]


def source(kind: str, path: str | Path, **keys: Any) -> dict[str, Any]:
    """A `data.sources` entry with the schema's defaults filled in."""
    props = load_schema()["$defs"]["source"]["properties"]
    return {**{k: v["default"] for k, v in props.items() if "default" in v}, "kind": kind, "path": str(path), **keys}


def config(sources: list[dict], tokenizer: Path | None, **data: Any) -> dict[str, Any]:
    cfg = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    cfg["data"].update({"tasks": [], "sources": sources, "n_eval": 0, "max_seq_len": MAX_LEN, "packing": False,
                        "on_bad_row": "error", **data})
    cfg["model"]["tokenizer"] = str(tokenizer) if tokenizer else None
    cfg.update(stage="prepare_data", key="test-shapes", upstream={})
    return cfg


def prepare(cfg: dict, tmp: Path, name: str, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(cfg))
    run_stage("prepare_data", ["--config", path, "--out", tmp / name], monkeypatch)
    return tmp / name


@pytest.fixture(scope="module")
def tool_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A BPE tokenizer (trained on the fixtures' text) with a chat template that renders tools and reasoning."""
    folder = tmp_path_factory.mktemp("tool-tokenizer")
    texts = [line for f in sorted(FIXTURES.rglob("*.jsonl")) for line in f.read_text().splitlines()]
    train_bpe_tokenizer(texts, 400, folder)
    (folder / "chat_template.jinja").write_text((FIXTURES / "tool_chat_template.jinja").read_text())
    return folder


@pytest.fixture(scope="module")
def hf(tool_tokenizer: Path) -> transformers.PreTrainedTokenizerBase:
    return transformers.AutoTokenizer.from_pretrained(str(tool_tokenizer))


@pytest.fixture(scope="module")
def prepared(tool_tokenizer: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    import datasets

    tmp = tmp_path_factory.mktemp("shapes")
    saved = tmp / "saved"
    datasets.DatasetDict({split: datasets.Dataset.from_list(rows) for split, rows in SAVED.items()}).save_to_disk(str(saved))
    sources = [
        source("sft", FIXTURES / "sharegpt.jsonl"),
        source("sft", FIXTURES / "openai_tool_calls.jsonl"),
        source("sft", saved, split="test"),
        source("sft", FIXTURES / "hub_folder", split="test"),
        source("sft", FIXTURES / "lm_text.jsonl", split="train[1:]"),
        source("sft", FIXTURES / "prompt_completion_standard.jsonl", render="raw"),
        source("preference", FIXTURES / "ultrafeedback_binarized.jsonl"),
        source("preference", FIXTURES / "trl_implicit_prompt.jsonl"),
        source("preference", FIXTURES / "hh_rlhf.jsonl"),
        source("preference", FIXTURES / "preference_standard_implicit.jsonl", render="raw"),
        source("unpaired", FIXTURES / "kto_renamed.jsonl", columns={"prompt": "question", "completion": "reply", "label": "thumbs_up"}),
        source("prompts", FIXTURES / "prompt_only.jsonl"),
        source("prompts", FIXTURES / "prompt_only_standard.jsonl", render="raw"),
    ]
    with pytest.MonkeyPatch.context() as mp:
        return prepare(config(sources, tool_tokenizer), tmp, "data", mp)


def hf_ids(hf: Any, messages: list[dict], tools: list | None = None, generation: bool = False) -> list[int]:
    return list(hf.apply_chat_template(messages, tools=tools, add_generation_prompt=generation, tokenize=True, return_dict=False))


def assistant_positions(hf: Any, messages: list[dict], tools: list | None, first: int = 0) -> set[int]:
    """Positions of each assistant turn (from its first token through its end-of-turn token), by transformers."""
    im_end = hf.convert_tokens_to_ids(IM_END)
    out: set[int] = set()
    for i, m in enumerate(messages):
        if m["role"] == "assistant" and i >= first:
            start = len(hf_ids(hf, messages[:i], tools, generation=True))
            through = hf_ids(hf, messages[: i + 1], tools)
            assert through[-2] == im_end and hf.decode(through[-1:]) == "\n"  # the newline after the turn is untrained
            out |= set(range(start, len(through) - 1))
    return out


def text_expected(hf: Any, prompt: str, completion: str) -> tuple[list[int], set[int]]:
    """Plain text as TRL tokenizes it: tokenizer(prompt + completion) + eos, trained from the completion's first token."""
    enc = hf(prompt + completion, return_offsets_mapping=True)
    ids = [*enc["input_ids"], hf.eos_token_id]
    first = next(t for t, (_, end) in enumerate(enc["offset_mapping"]) if end > len(prompt))
    return ids, set(range(max(first, 1), len(ids)))


def trained(ids: list[int], labels: list[int]) -> set[int]:
    """Positions trained (labels[t] predicts ids[t + 1]), checking the labels are the shifted ids."""
    out = {t + 1 for t, label in enumerate(labels) if label != IGNORE_INDEX}
    assert all(labels[t - 1] == ids[t] for t in out)
    return out


def test_sft_shapes_match_transformers_chat_template(prepared: Path, hf: Any) -> None:
    split = load_split(prepared, "sft")[:]
    assert split["input_ids"].shape == (len(SFT_EXPECTED), MAX_LEN)
    pad = hf.convert_tokens_to_ids("<|endoftext|>")
    for row, expected in enumerate(SFT_EXPECTED):
        ids_row, labels_row = split["input_ids"][row].tolist(), split["labels"][row].tolist()
        if isinstance(expected[0], str):
            ids, positions = text_expected(hf, *expected)
        else:
            messages, tools, *first = expected
            ids, positions = hf_ids(hf, messages, tools), assistant_positions(hf, messages, tools, *first)
        n = len(ids)
        assert ids_row[:n] == ids and set(ids_row[n:]) <= {pad}, f"sft row {row}"
        assert trained(ids_row, labels_row) == positions, f"sft row {row}"
    # The words on trained tokens: the assistant turns (tool calls and reasoning included), never a user or tool turn.
    tool_row = split["input_ids"][2].tolist()
    runs = trained_runs(hf, tool_row, split["labels"][2].tolist())
    assert runs == ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
                    "<think>\nThe tool reports 18 C with clouds.\n</think>\n\nIt is 18 C and cloudy in Paris.<|im_end|>"]
    text = hf.decode(tool_row, skip_special_tokens=False)
    assert text.count("get_weather") == 2 and "<tool_response>" in text  # in the tools block and in the call
    assert "Never read" not in hf.decode(split["input_ids"].ravel().tolist())  # the save_to_disk train split
    stats = json.loads((prepared / "stats.json").read_text())["splits"]["sft"]
    assert "reasoning_not_rendered" not in stats  # this template renders reasoning


def trained_runs(hf: Any, ids: list[int], labels: list[int]) -> list[str]:
    positions = sorted(trained(ids, labels))
    runs, current = [], [positions[0]]
    for t in positions[1:]:
        if t != current[-1] + 1:
            runs.append(current)
            current = []
        current.append(t)
    runs.append(current)
    return [hf.decode([ids[t] for t in run], skip_special_tokens=False) for run in runs]


def test_preference_shapes_train_the_completion_once(prepared: Path, hf: Any) -> None:
    split = load_split(prepared, "preference")[:]
    assert len(split["chosen_input_ids"]) == len(PREFERENCE_EXPECTED)
    for row, (prompt, chosen, rejected) in enumerate(PREFERENCE_EXPECTED):
        for side, completion in (("chosen", chosen), ("rejected", rejected)):
            ids_row = split[f"{side}_input_ids"][row].tolist()
            labels_row = split[f"{side}_labels"][row].tolist()
            if isinstance(prompt, str):
                ids, positions = text_expected(hf, prompt, completion)
            else:
                ids = hf_ids(hf, prompt + completion)
                start = len(hf_ids(hf, prompt, generation=True))
                positions = set(range(start, len(ids) - 1))
                assert positions == assistant_positions(hf, prompt + completion, None, first=len(prompt))
                text = hf.decode(ids_row, skip_special_tokens=False)
                for turn in prompt:  # each prompt turn exactly once: no duplicated user turn
                    assert text.count(f"<|im_start|>{turn['role']}\n{turn['content']}<|im_end|>") == 1
            assert ids_row == ids, f"preference row {row} {side}"
            assert trained(ids_row, labels_row) == positions, f"preference row {row} {side}"
            if not isinstance(prompt, str):  # the completion starts right after the prompt's generation prompt
                assert min(positions) == len(hf_ids(hf, prompt, generation=True))


def test_unpaired_and_prompt_only_shapes(prepared: Path, hf: Any) -> None:
    split = load_split(prepared, "unpaired")[:]
    assert len(split["desirable"]) == len(UNPAIRED_EXPECTED) + 2 * len(PREFERENCE_EXPECTED)  # + each pair's halves
    for row, (prompt, completion, desirable) in enumerate(UNPAIRED_EXPECTED):
        ids_row = split["chosen_input_ids"][row].tolist()
        assert ids_row == hf_ids(hf, prompt + completion) and bool(split["desirable"][row]) is desirable
        start = len(hf_ids(hf, prompt, generation=True))
        assert trained(ids_row, split["chosen_labels"][row].tolist()) == set(range(start, len(ids_row) - 1))
    prompts = load_split(prepared, "prompts")[:]
    raw = "Q: What is 3 + 4?\nA:"  # prompt_only_standard.jsonl, render: raw: the text as is, no template
    assert [p.tolist() for p in prompts["prompt_ids"]] == [*(hf_ids(hf, p, generation=True) for p in PROMPTS_EXPECTED),
                                                            hf(raw)["input_ids"]]
    assert list(prompts["answer"]) == ["8", "7", "7"]


def test_repeated_and_implicit_prompts_match_trl_extract_prompt() -> None:
    """UltraFeedback (prompt given and repeated), TRL's implicit prompt, and its standard text form: the
    rows split into prompt and completions as TRL's `maybe_extract_prompt` splits them."""
    from trl.data_utils import maybe_extract_prompt

    for name, render in (("ultrafeedback_binarized.jsonl", "chat"), ("trl_implicit_prompt.jsonl", "chat"),
                         ("preference_standard_implicit.jsonl", "raw")):
        raw = load_source(str(FIXTURES / name))
        ours, _ = canonical_rows(raw, "preference", name, render=render)
        theirs = [maybe_extract_prompt({k: row[k] for k in ("prompt", "chosen", "rejected") if k in row}) for row in raw]
        assert ours == [{k: t[k] for k in ("prompt", "chosen", "rejected")} for t in theirs], name


def canonical_rows_of(src: dict) -> list[dict]:
    return source_rows(src, "data.sources[0]", "0/data.sources[0]", skip_bad=False)[0]


def test_split_and_folders_are_honoured(tmp_path: Path) -> None:
    import datasets

    rows = [{"text": f"row {i}"} for i in range(10)]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [r["text"] for r in load_source(str(path), split="train[2:4]")] == ["row 2", "row 3"]
    assert [r["text"] for r in load_source(str(path), split="train[-10%:]")] == ["row 9"]
    with pytest.raises(ValueError, match=r"split 'test': a local file holds one split, train"):
        load_source(str(path), split="test")
    saved = tmp_path / "one"
    datasets.Dataset.from_list(rows).save_to_disk(str(saved))  # a Dataset, not a dict: its one split
    assert [r["text"] for r in load_source(str(saved), split="train[:2]")] == ["row 0", "row 1"]
    assert len(load_source(str(saved))) == 10
    folder = FIXTURES / "hub_folder"
    assert len(load_source(str(folder))) == 2 and len(load_source(str(folder), split="test")) == 2
    only = load_source(str(folder), data_files={"train": "test.jsonl"})
    assert [r["completion"][0]["content"] for r in only] == ["Haus", "Baeume"]
    # Row numbers in errors are the file's, also after a slice.
    with pytest.raises(ValueError, match=r"rows.jsonl: row 3: field messages is missing"):
        canonical_rows_of(source("sft", path, split="train[3:]", columns={"text": "nothing"}))


def test_mixing_weights_and_row_caps_are_deterministic(tmp_path: Path) -> None:
    rows = [{"n": i} for i in range(10)]
    assert mix(rows, 1.0, None, "k") is rows
    half = mix(rows, 0.5, None, "k")
    assert len(half) == 5 and half == mix(rows, 0.5, None, "k") and half != mix(rows, 0.5, None, "other seed")
    assert [r["n"] for r in half] == sorted(r["n"] for r in half)  # kept in data order
    twice = mix(rows, 2.0, None, "k")
    assert sorted(r["n"] for r in twice) == sorted(list(range(10)) * 2)
    one_and_half = mix(rows, 1.5, None, "k")
    counts = [sum(r["n"] == i for r in one_and_half) for i in range(10)]
    assert len(one_and_half) == 15 and sorted(counts) == [1] * 5 + [2] * 5
    capped = mix(rows, 2.0, 4, "k")
    assert len(capped) == 8 and len({r["n"] for r in capped}) == 4  # the cap applies first, then the weight
    path = tmp_path / "s.jsonl"
    path.write_text("".join(json.dumps({"text": f"t{i}"}) + "\n" for i in range(10)))
    got = canonical_rows_of(source("sft", path, weight=0.3, max_rows=6))
    assert len(got) == 2 and all(r["origin"].startswith(f"{path}: row ") for r in got)


def test_weighted_copies_never_leak_into_the_held_out_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": [user(f"Say {i}."), assistant(f"{i}")]}) + "\n" for i in range(40)))
    out = prepare(config([source("sft", path, weight=3)], None, n_eval=5, max_seq_len=32), tmp_path, "data", monkeypatch)
    train = {tuple(r.tolist()) for r in load_split(out, "sft")[:]["input_ids"]}
    held = [tuple(r.tolist()) for r in load_split(out, "sft_eval")[:]["input_ids"]]
    assert len(held) == 5 and len(set(held)) == 5 and not train & set(held)
    assert len(train) == 35  # the other 35 conversations, each three times (one row each, padded)
    assert len(load_split(out, "sft")) == 105


def test_schema_docs_and_reader_agree_on_every_column_and_key() -> None:
    props = load_schema()["$defs"]["source"]["properties"]
    assert props["columns"]["propertyNames"]["enum"] == list(COLUMN_FIELDS)
    assert props["kind"]["enum"] == list(KINDS) and props["render"]["enum"] == list(RENDERS)
    assert set(props) == SOURCE_KEYS
    docs = (ROOT / "docs" / "data.md").read_text()
    assert all(f"`{field}`" in docs for field in COLUMN_FIELDS) and all(f"`{key}`" in docs for key in props)
    # KTO's renamed columns are accepted by the schema (they were refused before).
    kto = {"kind": "unpaired", "path": str(FIXTURES / "kto_renamed.jsonl"),
           "columns": {"prompt": "question", "completion": "reply", "label": "thumbs_up"}, "weight": 2, "max_rows": 10}
    checked = validate_config({"data": {"sources": [kto]}})["data"]["sources"][0]
    assert checked["columns"] == kto["columns"] and checked["render"] == "chat"


GOOD_PAIR = {"prompt": "Which planet is red?", "chosen": "Mars.", "rejected": "Venus."}
TOOL_CALL = {"role": "assistant", "content": None,
             "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]}
# (name, kind, rows (the last one bad), source keys, the tokenizer (tools: the tool template; None: the preset's ChatML),
#  the error after "<file>: row <last>: ")
BAD_INPUTS = [
    ("missing field", "preference", [GOOD_PAIR, {"prompt": "Which planet is red?", "chosen": "Mars."}], {}, "tools",
     "field rejected is missing"),
    ("wrong type", "sft", [{"messages": [user("hi"), assistant("hello")]}, {"messages": [user("hi"), {"role": "assistant", "content": 5}]}],
     {}, "tools", "field messages message 1 needs a string 'content' (int)"),
    ("prompt does not prefix chosen", "preference",
     [{"prompt": "Which moon is largest?", "chosen": [user("Which planet is red?"), assistant("Mars.")],
       "rejected": [user("Which planet is red?"), assistant("Venus.")]}], {}, "tools",
     "field chosen does not start with the prompt: its message 0 is user 'Which planet is red?', the prompt's is "
     "user 'Which moon is largest?'"),
    ("deprecated function_call", "sft",
     [{"messages": [user("Weather in Oslo?"), {"role": "assistant", "content": None,
                                               "function_call": {"name": "get_weather", "arguments": "{}"}}]}], {}, "tools",
     "field messages message 1: `function_call` (OpenAI's deprecated single-call format) is not supported; "
     "give `tool_calls`: [{type: function, function: {name, arguments}}]"),
    ("tool call without a name", "sft",
     [{"messages": [user("Weather?"), {"role": "assistant", "tool_calls": [{"type": "function", "function": {"arguments": "{}"}}]}]}],
     {}, "tools", "field messages message 1 tool_calls[0] needs function.name (OpenAI's {type: function, function: {name, arguments}})"),
    ("tool arguments not JSON", "sft",
     [{"messages": [user("Weather?"), {"role": "assistant", "tool_calls": [
         {"type": "function", "function": {"name": "get_weather", "arguments": "{city: Oslo"}}]}]}],
     {}, "tools", "field messages message 1 tool_calls[0] function.arguments is a string but not JSON (Expecting property name "
                  "enclosed in double quotes)"),
    ("tool calls, template without tools", "sft",
     [{"messages": [user("Weather in Oslo?"), TOOL_CALL, {"role": "tool", "tool_call_id": "c1", "content": "cold"},
                    assistant("It is cold.")]}], {}, None,
     "field messages message 1 has tool calls, and the chat template cannot render them (UndefinedError: 'dict object' has no "
     "attribute 'content'): use a model whose chat template supports tools"),
    ("tool calls with text, template without tools", "sft",
     [{"messages": [user("Weather in Oslo?"), {**TOOL_CALL, "content": "Checking."}, assistant("It is cold.")]}], {}, None,
     "field messages message 1 has tool calls, and the chat template does not render them (it renders the message the same "
     "without them): use a model whose chat template supports tools"),
    ("tools column, template without tools", "sft",
     [{"messages": [user("Weather?"), assistant("Sunny.")], "tools": [WEATHER_TOOL]}], {}, None,
     "field tools: the chat template does not render tools (it renders the chat the same without them): use a model "
     "whose chat template supports tools"),
    ("ShareGPT speaker without a role", "sft",
     [{"conversations": [{"from": "human", "value": "hi"}, {"from": "bot", "value": "hello"}]}], {}, "tools",
     "field messages (column 'conversations') message 1 has the ShareGPT speaker 'bot' (`from`), which maps to no role; known: "
     "assistant, bard, bing, chatgpt, function_call, gpt, human, model, observation, system, tool, user; map it with the "
     "source's `roles`"),
    ("no prompt, nothing in common", "preference",
     [{"chosen": [user("a"), assistant("b")], "rejected": [user("c"), assistant("d")]}], {}, "tools",
     "field prompt is missing, and chosen and rejected share no leading message to take as the prompt"),
    ("KTO label not a boolean", "unpaired",
     [{"question": "Is 9 prime?", "reply": "No.", "thumbs_up": True}, {"question": "Is 9 prime?", "reply": "Yes.", "thumbs_up": "yes"}],
     {"columns": {"prompt": "question", "completion": "reply", "label": "thumbs_up"}}, "tools",
     "field label (column 'thumbs_up') must be true/false (or 1/0), got 'yes'"),
]


@pytest.mark.parametrize("name,kind,rows,keys,tokenizer,error", BAD_INPUTS, ids=[case[0] for case in BAD_INPUTS])
def test_bad_input_is_one_line_naming_file_row_and_field(name: str, kind: str, rows: list, keys: dict, tokenizer: str | None,
                                                         error: str, tool_tokenizer: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = config([source(kind, path, **keys)], tool_tokenizer if tokenizer else None)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        prepare(cfg, tmp_path, "data", monkeypatch)
    assert exited.value.code == 1
    assert capsys.readouterr().err.splitlines()[-1] == f"prepare_data: error: {path}: row {len(rows) - 1}: {error}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.json", "rows.jsonl"]  # nothing under the output name

    cfg["data"]["on_bad_row"] = "skip"  # the good rows prepare; the bad one is counted
    if len(rows) > 1:
        out = prepare(cfg, tmp_path, "skipped", monkeypatch)
        split = {"preference": "preference", "unpaired": "unpaired"}.get(kind, "sft")
        stats = json.loads((out / "stats.json").read_text())["splits"][split]
        assert stats["bad_rows_skipped"] == 1 and stats["rows"] == len(rows) - 1


def test_a_split_a_local_file_lacks_is_refused_before_anything_is_written(tool_tokenizer: Path, tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch,
                                                                          capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"messages": [user("hi"), assistant("hello")]}) + "\n")
    capsys.readouterr()
    with pytest.raises(SystemExit):
        prepare(config([source("sft", path, split="test")], tool_tokenizer), tmp_path, "data", monkeypatch)
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"prepare_data: error: data source {path}: split 'test': a local file holds one split, train (slices such as "
        "train[:100] or train[10%:] select rows of it; a folder or hub dataset has more splits)")
    assert not (tmp_path / "data").exists()


def test_roles_map_speakers_and_roles() -> None:
    rows = [{"conversations": [{"from": "human", "value": "hi"}, {"from": "bot", "value": "hello"}]},
            {"messages": [{"role": "человек", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
            {"conversations": [{"from": "human", "value": "Weather?"},
                               {"from": "function_call", "value": '{"name": "get_weather", "arguments": {"city": "Oslo"}}'},
                               {"from": "observation", "value": "cold"}, {"from": "gpt", "value": "Cold."}]}]
    got, _ = canonical_rows(rows, "sft", "r.jsonl", roles={"bot": "assistant", "человек": "user"})
    assert got[0]["messages"] == got[1]["messages"] == [user("hi"), assistant("hello")]
    assert got[2]["messages"] == [user("Weather?"),
                                  {"role": "assistant", "tool_calls": [{"type": "function", "function": {
                                      "name": "get_weather", "arguments": {"city": "Oslo"}}}]},
                                  {"role": "tool", "content": "cold"}, assistant("Cold.")]


def test_reasoning_a_template_leaves_out_is_counted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps({"messages": [user(f"Is {i} even?"), {**assistant("yes" if i % 2 == 0 else "no"),
                                                                             "reasoning_content": f"{i} mod 2"}]}) + "\n"
                            for i in range(4)))
    out = prepare(config([source("sft", path)], None), tmp_path, "data", monkeypatch)  # the preset's ChatML: no reasoning
    assert json.loads((out / "stats.json").read_text())["splits"]["sft"]["reasoning_not_rendered"] == 4
    text = Tokenizer(out / "tokenizer").decode(load_split(out, "sft")[:]["input_ids"].ravel().tolist())
    assert "mod 2" not in text and "yes" in text
