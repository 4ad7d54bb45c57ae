"""Chat formatting, loss masks, labels, truncation, packing, and document isolation in the model."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from posttrain.data.chat import IGNORE_INDEX, shifted_labels, tokenize_chat
from posttrain.data.loader import TRIM_MULTIPLE, length_multiple, sft_rows_batch
from posttrain.data.packing import best_fit_decreasing, build_rows, pack_or_pad, shortest_rows
from posttrain.data.tokenize import preference_split, prompt_split, sft_split
from posttrain.losses.ce import linear_cross_entropy
from posttrain.models import Transformer, document_positions, preset_config
from posttrain.tokenizer import IM_END, Tokenizer, train_bpe_tokenizer

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Compute 12 + 345."},
    {"role": "assistant", "content": "#### 357"},
    {"role": "user", "content": "Reverse: 4, 5"},
    {"role": "assistant", "content": "#### 5, 4"},
]
ASSISTANT = [m["content"] for m in CHAT if m["role"] == "assistant"]


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    texts = [f"{m['role']}\n{m['content']}" for m in CHAT] + [f"Compute {a} * {a + 7}. #### {a * (a + 7)}" for a in range(300)]
    return train_bpe_tokenizer(texts, 320, tmp_path_factory.mktemp("tok"))


def _runs(tok: Tokenizer, ids: list[int], mask: list[bool]) -> list[str]:
    """Decoded text of each maximal run of masked tokens."""
    runs, current = [], []
    for i, m in zip(ids, mask):
        if m:
            current.append(i)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tok.decode(r, skip_special_tokens=False) for r in runs]


def test_loss_masks_cover_exactly_the_assistant_tokens(tok: Tokenizer) -> None:
    ids, mask = tokenize_chat(tok, CHAT, "assistant")
    assert ids == tok.apply_chat_template(CHAT, tokenize=True)
    assert _runs(tok, ids, mask) == [a + IM_END for a in ASSISTANT]
    assert sum(mask) == sum(len(tok.encode(a)) + 1 for a in ASSISTANT)

    ids, mask = tokenize_chat(tok, CHAT, "last_turn")
    assert _runs(tok, ids, mask) == [ASSISTANT[-1] + IM_END]

    ids, mask = tokenize_chat(tok, CHAT, "all")
    assert all(mask) and len(mask) == len(ids)

    ids, mask = tokenize_chat(tok, CHAT, "assistant", first_trained_message=3)  # preference: completion only
    assert _runs(tok, ids, mask) == [ASSISTANT[-1] + IM_END]
    with pytest.raises(ValueError, match="loss_mask"):
        tokenize_chat(tok, CHAT, "assistant_only")


def test_loss_mask_for_template_that_rewrites_prefixes(tok: Tokenizer, tmp_path: Path) -> None:
    # The last message gets a trailer, so a rendered prefix is not a prefix of the whole chat:
    # the mask must come from locating the content, not from prefix diffs.
    folder = tmp_path / "odd"
    tok.save(folder)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["chat_template"] = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}<|im_end|>{% if loop.last %}[fin]{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    odd = Tokenizer(folder)
    ids, mask = tokenize_chat(odd, CHAT, "assistant")
    assert _runs(odd, ids, mask) == [a + IM_END for a in ASSISTANT]


def test_labels_are_shifted_next_tokens() -> None:
    ids, mask = [5, 6, 7, 8, 9], [False, False, True, True, False]
    assert shifted_labels(ids, mask) == [IGNORE_INDEX, 7, 8, IGNORE_INDEX, IGNORE_INDEX]


def test_sft_truncation_counts(tok: Tokenizer) -> None:
    short = {"messages": CHAT[1:3]}
    long_answer = {"messages": [{"role": "user", "content": "Compute 1 + 1."}, {"role": "assistant", "content": "1 " * 40}]}
    long_prompt = {"messages": [{"role": "user", "content": "9 " * 60}, {"role": "assistant", "content": "#### 1"}]}
    rows = [short, long_answer, long_prompt]
    n_short = len(tok.apply_chat_template(short["messages"], tokenize=True))
    max_len = n_short + 4

    columns, stats = sft_split(rows, tok, max_len, "assistant", "right", packing=False)
    assert (stats["truncated"], stats["dropped_too_long"], stats["dropped_no_loss_tokens"]) == (1, 0, 1)
    assert stats["documents"] == stats["rows"] == 2 and columns["input_ids"].shape == (2, max_len)
    cut = columns["labels"][1]
    assert cut[-1] == IGNORE_INDEX and (cut != IGNORE_INDEX).sum() > 0  # the kept part of the answer is trained

    _, stats = sft_split(rows, tok, max_len, "assistant", "drop", packing=False)
    assert (stats["truncated"], stats["dropped_too_long"], stats["documents"]) == (0, 2, 1)
    with pytest.raises(ValueError, match="truncation"):
        sft_split(rows, tok, max_len, "assistant", "left", packing=False)


def test_preference_masks_and_truncation(tok: Tokenizer) -> None:
    prompt = [{"role": "user", "content": "Compute 2 * 3."}]
    pair = {"prompt": prompt, "chosen": [{"role": "assistant", "content": "#### 6"}],
            "rejected": [{"role": "assistant", "content": "#### 5 " + "5 " * 30}]}
    n_prompt = len(tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True))
    columns, stats = preference_split([pair], tok, 64, "right")
    chosen_ids, chosen_labels = columns["chosen_input_ids"][0], columns["chosen_labels"][0]
    trained = [label for label in chosen_labels if label != IGNORE_INDEX]
    assert tok.decode(trained, skip_special_tokens=False) == "#### 6" + IM_END
    assert all(label == IGNORE_INDEX for label in chosen_labels[: n_prompt - 1])  # prompt never trained
    assert chosen_ids[:n_prompt] == columns["rejected_input_ids"][0][:n_prompt]
    assert stats["truncated"] == 1 and len(columns["rejected_input_ids"][0]) == 64
    _, stats = preference_split([pair], tok, 64, "drop")
    assert (stats["rows"], stats["dropped_too_long"]) == (0, 1)


def test_prompts_keep_examples_and_drop_too_long(tok: Tokenizer) -> None:
    rows = [
        {"id": "a", "task": "arithmetic", "prompt": "Compute 1 + 2.", "answer": "3",
         "example": {"id": "a", "task": "arithmetic", "prompt": "Compute 1 + 2.", "answer": "3", "difficulty": 1}},
        {"id": "b", "task": "t", "prompt": [{"role": "user", "content": "9 " * 80}], "answer": "9", "example": {}},
    ]
    columns, stats = prompt_split(rows, tok, 32)
    assert (stats["rows"], stats["dropped_too_long"]) == (1, 1)
    assert tok.decode(columns["prompt_ids"][0], skip_special_tokens=False).endswith("<|im_start|>assistant\n")
    assert json.loads(columns["example"][0])["difficulty"] == 1


def test_best_fit_decreasing_places_every_document_once() -> None:
    rng = random.Random(0)
    lengths = [rng.randint(1, 100) for _ in range(500)]
    rows = best_fit_decreasing(lengths, 128)
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in row) <= 128 for row in rows)
    assert all(row == sorted(row) for row in rows) and [r[0] for r in rows] == sorted(r[0] for r in rows)
    assert rows == best_fit_decreasing(lengths, 128)
    lower_bound = -(-sum(lengths) // 128)
    assert len(rows) <= lower_bound * 1.05 + 1
    with pytest.raises(ValueError, match="1..128"):
        best_fit_decreasing([129], 128)


def test_rows_mark_documents_and_padding() -> None:
    docs = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    labels = [[2, 3, IGNORE_INDEX], [5, IGNORE_INDEX], [7, 8, 9, IGNORE_INDEX]]
    cols = build_rows(docs, labels, [[0, 1], [2]], 6, pad_id=0)
    np.testing.assert_array_equal(cols["input_ids"], [[1, 2, 3, 4, 5, 0], [6, 7, 8, 9, 0, 0]])
    np.testing.assert_array_equal(cols["document_ids"], [[0, 0, 0, 1, 1, 2], [0, 0, 0, 0, 1, 1]])
    np.testing.assert_array_equal(cols["labels"][1], [7, 8, 9, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX])
    padded = pack_or_pad(docs, labels, 6, 0, packing=False)
    assert padded["input_ids"].shape == (3, 6)


def test_packed_documents_never_see_each_other_in_the_model(tok: Tokenizer) -> None:
    rows = [{"messages": [{"role": "user", "content": f"Compute {a} + {a * 3}."},
                          {"role": "assistant", "content": f"#### {a * 4}"}]} for a in range(10, 40)]
    columns, stats = sft_split(rows, tok, 96, "assistant", "right", packing=True)
    assert stats["rows"] < stats["documents"]
    torch.manual_seed(0)
    model = Transformer(preset_config("tiny-student", vocab_size=tok.vocab_size)).eval()
    ids = torch.from_numpy(columns["input_ids"][:2]).long()
    docs = torch.from_numpy(columns["document_ids"][:2]).long()
    assert int(docs[0].max()) >= 2  # at least two documents and a padding tail in the row
    with torch.no_grad():
        hidden = model(ids, document_ids=docs)
        perturbed = ids.clone()
        target = docs == 1
        perturbed[target] = (perturbed[target] + 7) % tok.vocab_size
        hidden_perturbed = model(perturbed, document_ids=docs)
        assert not torch.allclose(hidden[target], hidden_perturbed[target])
        torch.testing.assert_close(hidden[~target], hidden_perturbed[~target], rtol=0, atol=1e-6)
        # Each document, alone and unpacked, gets the same hidden states as inside the packed row.
        for d in range(int(docs[0].max())):
            alone = ids[0][docs[0] == d][None]
            torch.testing.assert_close(model(alone)[0], hidden[0][docs[0] == d], rtol=1e-5, atol=1e-5)


def test_multiprocess_tokenization_matches_one_process(tok: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    import posttrain.data.tokenize as tokenize

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 cores to run datasets.map with num_proc=2")
    rows = [{"messages": [{"role": "user", "content": f"Compute {a} * 3."}, {"role": "assistant", "content": f"#### {3 * a}"}]}
            for a in range(120)]
    one, stats_one = sft_split(rows, tok, 64, "assistant", "right", packing=True)
    monkeypatch.setattr(tokenize, "ROWS_PER_PROCESS", 60)
    assert tokenize._num_proc(len(rows)) == 2
    two, stats_two = sft_split(rows, tok, 64, "assistant", "right", packing=True)
    assert stats_one == stats_two
    for key in one:
        np.testing.assert_array_equal(one[key], two[key])


def test_padded_batches_go_padding_free_and_are_cut_after_the_last_trained_token_with_the_same_loss() -> None:
    torch.manual_seed(0)
    model = Transformer(preset_config("tiny-student", vocab_size=256)).eval()

    def loss(b: dict[str, torch.Tensor]) -> torch.Tensor:
        with torch.no_grad():
            hidden = model(b["input_ids"], position_ids=document_positions(b["document_ids"]), document_ids=b["document_ids"])
            return linear_cross_entropy(hidden, model.lm_head, b["labels"], reduction="sum")

    def rows_of(lengths: tuple[int, ...], grouping: list[list[int]] | None = None) -> dict[str, torch.Tensor]:
        """One padded document per row, or the documents grouped into rows as given."""
        docs = [list(range(1, n + 1)) for n in lengths]
        labels = [[IGNORE_INDEX] * 5 + d[6:] + [IGNORE_INDEX] for d in docs]  # prompt, then shifted targets
        rows = build_rows(docs, labels, grouping, 256, 0) if grouping else pack_or_pad(docs, labels, 256, 0, False)
        return {k: torch.from_numpy(v.astype(np.int64)) for k, v in rows.items()}

    # (documents, rows and length of the batch): three short padded rows share one row (spans of
    # 19 + 69 + 8 tokens, cut at 128); spans that fill a row each stay where they are; two rows of
    # two documents each become one row of four documents that never attend to each other.
    # Eager runs cut to a multiple of 8, and spread the spans (199, 29, 39, 19) over their two rows so
    # that the fuller is as short as it can be: 199 | 29 + 39 + 19, not best fit's 199 + 39 | 29 + 19.
    cases = [((20, 70, 9), None, TRIM_MULTIPLE, (1, TRIM_MULTIPLE * 2)), ((200, 180), None, TRIM_MULTIPLE, (2, 256)),
             ((60, 30, 50, 40), [[0, 1], [2, 3]], TRIM_MULTIPLE, (1, TRIM_MULTIPLE * 3)),
             ((200, 30, 40, 20), None, length_multiple(compiled=False), (2, 200)),
             ((200, 30, 40, 20), None, length_multiple(compiled=True), (2, 256))]
    for lengths, grouping, multiple, shape in cases:
        rows = rows_of(lengths, grouping)
        batch = sft_rows_batch(rows["input_ids"], rows["labels"], rows["document_ids"], multiple=multiple)
        assert tuple(batch["input_ids"].shape) == shape, lengths
        assert int((batch["labels"] != IGNORE_INDEX).sum()) == int((rows["labels"] != IGNORE_INDEX).sum())
        torch.testing.assert_close(loss(batch), loss(rows), rtol=1e-5, atol=0)
    rows = rows_of((20, 70, 9))
    untrained = sft_rows_batch(rows["input_ids"], torch.full_like(rows["labels"], IGNORE_INDEX), rows["document_ids"])
    assert untrained["input_ids"].shape == (3, TRIM_MULTIPLE)


def test_shortest_rows_bisects_the_row_length_and_keeps_the_row_count() -> None:
    lengths = [199, 29, 39, 19]
    assert [sum(lengths[i] for i in g) for g in best_fit_decreasing(lengths, 256)] == [238, 48]
    assert shortest_rows(lengths, 2, 256, 8) == [[0], [1, 2, 3]]
    assert shortest_rows(lengths, 2, 256, 64) == best_fit_decreasing(lengths, 256)  # 256 is the first multiple >= 199
    even = [50] * 6
    assert [sum(even[i] for i in g) for g in shortest_rows(even, 2, 256, 1)] == [150, 150]
    assert length_multiple(compiled=False, tp=2) == 8 and length_multiple(compiled=False, tp=16) == 16
    assert length_multiple(compiled=True, tp=4) == TRIM_MULTIPLE
