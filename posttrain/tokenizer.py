"""Tokenizers for HF tokenizer folders, chat template rendering, and BPE training for the presets.

A folder holds `tokenizer.json` (the `tokenizers` pipeline) and `tokenizer_config.json` (special
tokens, `chat_template`), as `transformers` writes them. Chat templates are rendered with Jinja the
way `transformers.apply_chat_template` renders them (sandboxed, `trim_blocks`/`lstrip_blocks`,
`raise_exception`, `tojson`, special tokens as template variables), so the ids we train on are the
ids `transformers` and vLLM produce for the same chat. Loading a folder never runs remote code.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Regex, Tokenizer as _HFTokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

# Files of an HF tokenizer folder that travel with it when copied.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Tokens that close a chat turn in common templates; a generation also stops at them.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>")

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# ChatML as Qwen renders it, without a default system prompt (tiny models have no room for one).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Qwen2's pre-tokenizer split: single digits (\p{N}), so each digit is its own token and
# multi-digit arithmetic stays learnable by a tiny model.
_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


class TokenizerError(ValueError):
    """A tokenizer folder that cannot be used."""


# ChatML with tools in the Hermes / Qwen convention: the tools' schemas in the system turn, an assistant's calls as
# <tool_call> JSON blocks after its text, tool results as <tool_response> blocks in a user turn
# (`posttrain.envs.tool_calls` parses what this renders).
CHATML_TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n\n' }}{% endif %}"
    "# Tools\n\nThese functions can be called:\n<tools>"
    "{% for tool in tools %}{{ '\n' + (tool | tojson) }}{% endfor %}"
    "{{ '\\n</tools>\\n\\nTo call one, write <tool_call>{\"name\": <name>, \"arguments\": <object>}</tool_call>.' }}"
    "<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and tools and loop.first %}"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\n<tool_response>\n' + message['content'] + '\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\n' }}{% endif %}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') }}"
    "{% for call in message.get('tool_calls', []) %}"
    "{% if (message['content'] or '') or not loop.first %}{{ '\n' }}{% endif %}"
    "{{ '<tool_call>\n{\"name\": \"' + call['function']['name'] + '\", \"arguments\": '"
    " + (call['function']['arguments'] | tojson) + '}\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
NAMED_TEMPLATES = {"chatml": CHATML_TEMPLATE, "chatml-tools": CHATML_TOOLS_TEMPLATE}  # names, not files


def read_chat_template(value: str) -> str:
    """The template `model.chat_template` names: one of `NAMED_TEMPLATES`, or a Jinja file's text."""
    if value in NAMED_TEMPLATES:
        return NAMED_TEMPLATES[value]
    path = Path(value).expanduser()
    if not path.is_file():
        raise TokenizerError(f"model.chat_template: {value}: no such file (a Jinja template file, or one of "
                             f"{', '.join(NAMED_TEMPLATES)})")
    template = path.read_text(encoding="utf-8")
    compile_chat_template(template)  # a syntax error names the file here, not at the first row
    return template


def set_chat_template(folder: str | Path, template: str) -> None:
    """Make `template` the tokenizer folder's chat template: `chat_template.jinja`, which both this reader and
    transformers take over the one in `tokenizer_config.json`."""
    (Path(folder) / "chat_template.jinja").write_text(template, encoding="utf-8")


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` blocks (assistant-mask markers) render their body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """`namespace()` that refuses underscore attributes, so a template cannot reach Python internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat template set the underscore attribute {name!r}")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters; chat templates expect plain JSON.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=16)
def compile_chat_template(template: str) -> jinja2.Template:
    """Compile a chat template in the sandboxed environment `transformers` uses."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["namespace"] = _Namespace
    return env.from_string(template)


def _token_content(value: Any) -> str | None:
    """Special tokens are written as a string or as an AddedToken dict with `content`."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise TokenizerError(f"{path}: not valid JSON ({err})") from err


def _read_chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    """The folder's default chat template: `chat_template.jinja`, `chat_template.json`, or the config key."""
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text(encoding="utf-8")
    if (folder / "chat_template.json").is_file():
        return _read_json(folder / "chat_template.json").get("chat_template")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default")
    return template


def folder_chat_template(folder: str | Path) -> str | None:
    """The chat template a tokenizer folder brings (None: it has none, as base models often do)."""
    folder = Path(folder)
    config = _read_json(folder / "tokenizer_config.json") if (folder / "tokenizer_config.json").is_file() else {}
    return _read_chat_template(folder, config)


class Tokenizer:
    """An HF tokenizer folder: encode/decode, special tokens, chat template rendering.

    Picklable (for `datasets.map(num_proc=...)`): the compiled template is cached per process.
    """

    def __init__(self, folder: str | Path):
        folder = Path(folder)
        if not (folder / "tokenizer.json").is_file():
            raise TokenizerError(
                f"{folder}: no tokenizer.json (posttrain needs a fast tokenizer; "
                "slow sentencepiece-only folders are not supported)"
            )
        self.folder = folder
        self._tok = _HFTokenizer.from_file(str(folder / "tokenizer.json"))
        config = _read_json(folder / "tokenizer_config.json") if (folder / "tokenizer_config.json").is_file() else {}
        if (folder / "special_tokens_map.json").is_file():  # legacy layout: fills what the config lacks
            legacy = _read_json(folder / "special_tokens_map.json")
            config = {**config, **{k: v for k, v in legacy.items() if k in SPECIAL_TOKEN_NAMES and config.get(k) is None}}
        self.config = config
        self.chat_template = _read_chat_template(folder, config)
        self.special_tokens: dict[str, str] = {}
        for name in SPECIAL_TOKEN_NAMES:
            content = _token_content(config.get(name))
            if content is None:
                continue
            if self._tok.token_to_id(content) is None:
                raise TokenizerError(f"{folder}/tokenizer_config.json: {name} {content!r} is not in the vocabulary")
            self.special_tokens[name] = content
        gen_path = folder / "generation_config.json"
        self._generation_eos = _read_json(gen_path).get("eos_token_id") if gen_path.is_file() else None

    # ----- vocabulary and special tokens -----
    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (the model's embedding needs at least this many rows)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def _special_id(self, name: str) -> int | None:
        token = self.special_tokens.get(name)
        return None if token is None else self._tok.token_to_id(token)

    @property
    def bos_id(self) -> int | None:
        return self._special_id("bos_token")

    @property
    def eos_id(self) -> int | None:
        return self._special_id("eos_token")

    @property
    def pad_id(self) -> int:
        """The pad token, or the eos token for folders without one (Llama 3)."""
        pad = self._special_id("pad_token")
        if pad is None:
            pad = self.eos_id
        if pad is None:
            raise TokenizerError(f"{self.folder}: neither pad_token nor eos_token is set in tokenizer_config.json")
        return pad

    @property
    def eos_ids(self) -> list[int]:
        """Ids that end a generation: eos, generation_config's eos ids, and the template's end-of-turn token."""
        ids: list[int] = []
        if self.eos_id is not None:
            ids.append(self.eos_id)
        gen = self._generation_eos
        ids.extend([gen] if isinstance(gen, int) else list(gen or []))
        template = self.chat_template or ""
        for token in END_OF_TURN_TOKENS:
            token_id = self._tok.token_to_id(token)
            if token_id is not None and token in template:
                ids.append(token_id)
        return list(dict.fromkeys(ids))

    @property
    def stop_strings(self) -> list[str]:
        """Text of the eos ids, for engines that stop on strings."""
        return [self._tok.id_to_token(i) for i in self.eos_ids]

    # ----- encode / decode -----
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`. Special-token strings in the text map to their ids (as in `transformers`)."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch_with_offsets(self, texts: Sequence[str]) -> list[tuple[list[int], list[tuple[int, int]]]]:
        """Per text: ids and each token's character span in the text (no special tokens added)."""
        return [(e.ids, e.offsets) for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_batch(self, batch: Sequence[Sequence[int]], skip_special_tokens: bool = True) -> list[str]:
        return self._tok.decode_batch([list(ids) for ids in batch], skip_special_tokens=skip_special_tokens)

    # ----- chat -----
    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = False,
        tokenize: bool = False,
        **kwargs: Any,
    ) -> str | list[int]:
        """Render a chat as `transformers` does; `tokenize=True` returns its ids instead of the text.

        Keys whose value is None are dropped from each message, and the special tokens are template
        variables (`bos_token`, `eos_token`, ...), both as in `transformers`.
        """
        if not self.chat_template:
            raise TokenizerError(f"{self.folder}: the tokenizer has no chat_template")
        chat = [{k: v for k, v in dict(m).items() if v is not None} for m in messages]
        variables = {**self.special_tokens, **kwargs}
        text = compile_chat_template(self.chat_template).render(
            messages=chat, add_generation_prompt=add_generation_prompt, **variables
        )
        return self.encode(text) if tokenize else text

    # ----- files -----
    def save(self, out_dir: str | Path) -> None:
        """Copy the tokenizer files of the folder into `out_dir` (an HF model or data folder)."""
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        for name in TOKENIZER_FILES:
            if (self.folder / name).is_file():
                shutil.copyfile(self.folder / name, out_dir / name)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_tok"] = self._tok.to_str()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state["_tok"] = _HFTokenizer.from_str(state["_tok"])
        self.__dict__.update(state)


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: str | Path, model_max_length: int = 1024) -> Tokenizer:
    """Train a byte-level BPE tokenizer on local text and save it in HF layout with a ChatML template.

    Digits are split one per token. Special tokens: `<|endoftext|>` (pad), `<|im_start|>`,
    `<|im_end|>` (eos, closes each chat turn). `transformers.AutoTokenizer.from_pretrained(out_dir)`
    loads the result with the same ids and chat rendering.
    """
    special = [PAD_TOKEN, IM_START, IM_END]
    if vocab_size < 256 + len(special):
        raise ValueError(f"vocab_size {vocab_size} is below the 256 byte tokens plus {len(special)} special tokens")
    tok = _HFTokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    added = {
        str(tok.token_to_id(t)): {
            "content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True
        }
        for t in special
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHATML_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return Tokenizer(out_dir)
