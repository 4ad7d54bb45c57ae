"""Teacher, student and data must share one tokenizer and output vocabulary: KD compares distributions id by id."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer as HFTokenizer

from posttrain.model_files import resolve_model_source
from posttrain.models import Transformer, is_preset
from posttrain.models.hf_backend import transformers_config
from posttrain.tokenizer import Tokenizer
from posttrain.training.setup import model_config


class VocabularyMismatchError(ValueError):
    """Teacher, student and data do not share one tokenizer and output vocabulary."""


def _vocab(folder: Path) -> dict[str, int] | None:
    """Token -> id of a folder's tokenizer (added tokens included); None when it has no tokenizer.json."""
    path = folder / "tokenizer.json"
    return HFTokenizer.from_file(str(path)).get_vocab(with_added_tokens=True) if path.is_file() else None


def _vocab_difference(a: dict[str, int], b: dict[str, int]) -> str | None:
    if a == b:
        return None
    if len(a) != len(b):
        return f"{len(a)} vs {len(b)} token ids"
    token = next(t for t in sorted(a) if b.get(t) != a[t])
    return f"both have {len(a)} ids, but token {token!r} is id {a[token]} vs {b.get(token)}"


def check_same_vocabulary(
    data_tokenizer: Tokenizer,
    teacher_dir: Path,
    teacher_config: Mapping[str, Any],
    student_source: str,
    student_config: Mapping[str, Any],
) -> None:
    """Refuse a teacher and student whose tokenizers or output vocabularies differ.

    The divergence compares the two models' distributions id by id, and both read the data's
    token ids: the teacher's and a folder student's tokenizers must equal the data tokenizer, and
    both output heads must have the same width.
    """
    data_vocab = _vocab(data_tokenizer.folder)
    sides = [("teacher", teacher_dir)]
    if not is_preset(student_source):
        sides.append(("student", resolve_model_source(student_source)))
    for role, folder in sides:
        vocab = _vocab(folder)
        difference = None if vocab is None or data_vocab is None else _vocab_difference(vocab, data_vocab)
        if difference:
            raise VocabularyMismatchError(
                f"the {role}'s tokenizer ({folder}) differs from the data tokenizer ({data_tokenizer.folder}): "
                f"{difference}. Teacher and student must share one tokenizer and vocabulary"
            )
    teacher_width, student_width = int(teacher_config["vocab_size"]), int(student_config["vocab_size"])
    if teacher_width != student_width:
        student_where = f"preset {student_source!r}" if is_preset(student_source) else str(resolve_model_source(student_source))
        raise VocabularyMismatchError(
            f"teacher {teacher_dir} has a vocabulary of {teacher_width} ids (config.json vocab_size), student "
            f"{student_where} has {student_width}: distillation compares their output distributions id by id, "
            "so teacher and student must share one tokenizer and vocabulary"
        )


def student_config(source: str, tokenizer: Tokenizer, teacher_config: Mapping[str, Any]) -> dict[str, Any]:
    """The student's HF config; a preset's output head gets the teacher's width (padded vocabularies included)."""
    config = model_config(source, tokenizer)
    if is_preset(source):
        config["vocab_size"] = int(teacher_config["vocab_size"])
    return config


def parameter_count(hf_config: Mapping[str, Any], backend: str) -> int:
    """Parameters of the full (unsharded) model on `backend`'s code (the model's `backend`: native | transformers),
    tied embeddings counted once; built on the meta device, so nothing is allocated."""
    with torch.device("meta"):
        if backend == "transformers":
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_config(transformers_config(dict(hf_config)))
        else:
            model = Transformer(dict(hf_config))
        return sum(p.numel() for p in model.parameters())
