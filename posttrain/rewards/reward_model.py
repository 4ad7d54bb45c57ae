"""A scalar reward model: the policy's decoder with a linear `score` head in place of the LM head.

The reward of a sequence is the head applied to the final hidden state of its last real token.
Parameter names are those of Hugging Face's `<Family>ForSequenceClassification` (`model.*` and
`score.weight`; the class of each native family is in `posttrain.models.families`), and `save_reward_model`
writes that layout (`num_labels: 1`, `pad_token_id`), so `transformers.AutoModelForSequenceClassification`
and vLLM's reward pooling load the folder and read the same score at the same token (the rightmost non-pad
one) when sequences are right-padded. On the transformers backend (`model.backend`: a family without a
native port) the reward model is transformers' own sequence classifier of the family (`HFRewardModel`),
for the families transformers has one for (`posttrain.rules.reward_model_backend_problem`).

A reward model from elsewhere (`reward_model.source`: a folder or hub id with a `*ForSequenceClassification`
head and one label) has a tokenizer and chat template of its own: `PretrainedRewardModel` renders the
prompt and the completion as a conversation with them, as TRL does for its reward-model `reward_funcs`,
and scores that. `normalize_scores` puts either kind on a common scale before it is weighed.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from posttrain.model_files import (
    CheckpointError,
    load_state_into,
    model_tensors,
    read_hf_config,
    resolve_model_source,
    save_hf_model,
)
from posttrain.model_files.hf import (
    adapter_folded,
    architecture,
    checkpoint_state,
    folder_backend,
    is_adapter_folder,
    pretrained_checked,
)
from posttrain.losses.chunked import IGNORE_INDEX
from posttrain.models import ModelConfigError, Transformer
from posttrain.models.hf_backend import PARITY_TOLERANCE, TransformersModel, transformers_config
from posttrain.rewards.specs import RM_NORMALIZE, declares_classifier, sequence_classifier_problem
from posttrain.rules import reward_model_backend_problem
from posttrain.tokenizer import Tokenizer

SCORE_KEY = "score.weight"
CLASSIFIER_KEYS = ("architectures", "num_labels", "id2label", "label2id")  # what a causal LM's config lacks


class RewardModel(Transformer):
    """`Transformer` without `lm_head`, plus `score: Linear(hidden, 1, bias=False)`."""

    def __init__(self, hf_config: dict[str, Any]):
        super().__init__(hf_config)
        del self.lm_head
        self.score = nn.Linear(self.args.hidden_size, 1, bias=False)
        if not self.score.weight.is_meta:
            nn.init.normal_(self.score.weight, mean=0.0, std=self.args.initializer_range)

    def tie_weights(self) -> None:
        """Nothing to tie: the reward model has no output projection over the vocabulary."""

    def forward(self, input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """Rewards [B] of right-padded sequences `input_ids` [B, S] with `lengths` [B] real tokens each."""
        check_lengths(input_ids, lengths)
        return self.score(last_token(super().forward(input_ids), lengths)).squeeze(-1).float()


def check_lengths(input_ids: torch.Tensor, lengths: torch.Tensor) -> None:
    """Refuse `lengths` that are not one length in [1, S] per row of `input_ids` [B, S]."""
    if lengths.shape != input_ids.shape[:1]:
        raise ValueError(f"lengths {tuple(lengths.shape)} must have one entry per row of input_ids {tuple(input_ids.shape)}")
    if bool((lengths < 1).any()) or bool((lengths > input_ids.shape[1]).any()):
        raise ValueError(f"every length must be in [1, {input_ids.shape[1]}], got {lengths.tolist()}")


def last_token(hidden: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The hidden states [B, D] of each row's last real token."""
    return hidden[torch.arange(hidden.shape[0], device=hidden.device), lengths.to(hidden.device) - 1]


class HFRewardModel(TransformersModel):
    """The transformers backend's reward model: the family's own `*ForSequenceClassification` (one label), scoring
    as `RewardModel` does (`forward(input_ids, lengths)`: the `score` head at each row's last real token).

    The classifier's children (GPT-2's `transformer` and `score`) are registered as the wrapper's own, so its state
    dict is the classifier's checkpoint, as `HFCausalLM`'s is the causal LM's: what `save_reward_model` and the
    stage write, what transformers loads, and `score` is the name LoRA's `modules_to_save` keeps trainable.
    """

    def __init__(self, classifier: nn.Module, hf_config: dict[str, Any]):
        super().__init__(classifier, hf_config)
        score = self._modules.get("score")
        if not isinstance(score, nn.Linear) or score.out_features != 1:
            raise ModelConfigError(f"{type(classifier).__name__} has no `score` linear head of one output, which the "
                                   "reward model reads")

    @property
    def classifier(self) -> nn.Module:
        return self.wrapped

    def forward(self, input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Rewards [B] of right-padded sequences `input_ids` [B, S] with `lengths` [B] real tokens each; the padding is
        masked as transformers' scoring of a padded batch masks it."""
        check_lengths(input_ids, lengths)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        mask = (positions < lengths.to(input_ids.device)[:, None]).long()
        hidden = self.classifier.base_model(input_ids=input_ids, attention_mask=mask, use_cache=False).last_hidden_state
        return self.score(last_token(hidden, lengths)).squeeze(-1).float()


def scored_lengths(labels: torch.Tensor) -> torch.Tensor:
    """Per row, the length up to and including the last trained token (labels aligned as in `posttrain.losses`).

    `labels[t]` is the id trained at position t + 1, so a completion ending with its end-of-turn
    token at position t + 1 scores there; template text after the turn (ChatML's newline) is cut
    off, matching sampled rollouts, which end with that token.
    """
    trained = labels != IGNORE_INDEX
    if not bool(trained.any(-1).all()):
        raise ValueError("a preference row has no trained token; cannot find where its completion ends")
    positions = torch.arange(labels.shape[1], device=labels.device).expand_as(labels)
    return torch.where(trained, positions, -1).max(-1).values + 2


def pad_right(sequences: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([N, longest] ids right-padded with `pad_id`, [N] lengths)."""
    if not sequences or any(len(s) == 0 for s in sequences):
        raise ValueError("need at least one sequence and no empty sequence")
    lengths = torch.tensor([len(s) for s in sequences])
    ids = torch.full((len(sequences), int(lengths.max())), pad_id, dtype=torch.long)
    for i, seq in enumerate(sequences):
        ids[i, : len(seq)] = torch.as_tensor(list(seq), dtype=torch.long)
    return ids, lengths


@torch.no_grad()
def score_sequences(model: RewardModel, sequences: Sequence[Sequence[int]], pad_id: int, batch_size: int = 64) -> list[float]:
    """Rewards of token-id sequences (prompt + completion), in batches of `batch_size`."""
    device = next(model.parameters()).device
    rewards: list[float] = []
    for start in range(0, len(sequences), batch_size):
        ids, lengths = pad_right(sequences[start : start + batch_size], pad_id)
        rewards += model(ids.to(device), lengths.to(device)).tolist()
    return rewards


def load_reward_model(
    source: str | os.PathLike, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
    model_class: type[RewardModel] | None = None, backend: str = "auto",
) -> RewardModel | HFRewardModel:
    """A reward model from a folder written by `save_reward_model`, or a new one on a causal LM's decoder.

    From a causal LM folder (no `score.weight`) the LM head is dropped and the score head is drawn
    from torch's global RNG (seed it first for a reproducible start). `model_class`: a subclass
    with the same parameters (PPO's value model; native only). `backend` is `model.backend`: where it
    decides on transformers, the model is transformers' sequence classifier (`HFRewardModel`); the
    default, auto, lets the folder's model_type decide (a native family's scores are transformers' to 1e-4).
    """
    folder = resolve_model_source(source)
    config = read_hf_config(folder)
    if backend != "native" and folder_backend(config, backend, folder) == "transformers":
        if model_class is not None:
            raise CheckpointError(f"{folder}: a {model_class.__name__} runs on the native model code only, and "
                                  f"model.backend runs model_type {config.get('model_type')!r} on transformers")
        return load_transformers_reward_model(folder, config).to(device, dtype)
    tensors = model_tensors(folder)
    is_reward_model = declares_classifier(config)
    if is_reward_model and SCORE_KEY not in tensors:
        raise CheckpointError(f"{folder}: config.json declares a sequence-classification model but has no {SCORE_KEY!r}")
    if is_reward_model and int(config.get("num_labels", 1)) != 1:
        raise CheckpointError(f"{folder}/config.json: num_labels is {config['num_labels']}; a reward model has 1")
    config = {k: v for k, v in config.items() if k not in CLASSIFIER_KEYS}
    with torch.device("meta"):
        try:
            model = (model_class or RewardModel)(config)
        except ValueError as e:
            raise CheckpointError(f"{folder / 'config.json'}: {e}") from None
    model.to_empty(device=device)
    model.init_weights(buffers_only=True)
    state = {k: v for k, v in tensors.items() if k.startswith("model.") or k == SCORE_KEY}
    if SCORE_KEY not in state:
        state[SCORE_KEY] = torch.empty(1, model.args.hidden_size).normal_(0.0, model.args.initializer_range)
    load_state_into(model, state, str(folder))
    return model.to(dtype)


def load_transformers_reward_model(folder: Path, config: dict[str, Any]) -> HFRewardModel:
    """transformers' sequence classifier of the folder's family (float32, on CPU), from a reward model folder or on a
    causal LM's decoder (its head dropped, `score` drawn from torch's global RNG as `RewardModel`'s is), refusing
    missing, unexpected or misshapen tensors but those; an adapter-only folder: its base, with the adapter folded in."""
    from transformers import AutoModelForSequenceClassification

    where = str(folder / "config.json")
    why = reward_model_backend_problem(str(config.get("model_type")), "transformers")
    if why:
        raise CheckpointError(f"{where}: reward_model.source: {why}")
    if is_adapter_folder(folder):  # the adapter's `score` replaces the drawn one
        return adapter_folded(folder, load_transformers_reward_model)
    is_reward_model = declares_classifier(config)
    if is_reward_model and int(config.get("num_labels", 1)) != 1:
        raise CheckpointError(f"{where}: num_labels is {config['num_labels']}; a reward model has 1")
    config = {k: v for k, v in config.items() if k not in CLASSIFIER_KEYS}

    def new_head(classifier: nn.Module, kind: str, key: str) -> bool:
        """On a causal LM's decoder: the score head is new, the LM head left out."""
        return not is_reward_model and ((kind == "missing_keys" and key.startswith("score."))
                                        or (kind == "unexpected_keys"
                                            and not key.startswith(f"{classifier.base_model_prefix}.")))

    classifier = pretrained_checked(AutoModelForSequenceClassification, folder,
                                    transformers_config({**config, "num_labels": 1}, where), new_head)
    model = HFRewardModel(classifier, config)
    if not is_reward_model:
        with torch.no_grad():
            model.score.weight.normal_(0.0, float(getattr(classifier.config, "initializer_range", 0.02)))
            if model.score.bias is not None:
                model.score.bias.zero_()
    check_score_parity(model, where)
    return model


@torch.no_grad()
def check_score_parity(model: HFRewardModel, source: str) -> None:
    """Refuse a classifier whose own forward scores otherwise than `score` at the last token (a pooler, a scaling):
    on one unpadded row, ours must be transformers' logit."""
    was_training = model.training
    model.eval()
    config = model.classifier.config
    ids = [i for i in range(min(int(config.vocab_size), 6)) if i != config.pad_token_id][:4]
    tokens = torch.tensor([ids], device=next(model.parameters()).device)
    ours = float(model(tokens, torch.tensor([len(ids)], device=tokens.device))[0])
    theirs = float(model.classifier(input_ids=tokens).logits.float().reshape(-1)[0])
    model.train(was_training)
    if abs(ours - theirs) > PARITY_TOLERANCE * max(1.0, abs(theirs)):
        raise ModelConfigError(f"{source}: {config.model_type}'s sequence classifier scores otherwise than its `score` "
                               f"head at the last token ({theirs:.6g}, ours {ours:.6g}); not supported as a reward model")


def save_reward_model(model: RewardModel | HFRewardModel, out_dir: str | os.PathLike, pad_token_id: int,
                      dtype: torch.dtype = torch.float32) -> None:
    """Write the HF sequence-classification layout: config (`num_labels: 1`, `pad_token_id`) and safetensors."""
    save_hf_model(checkpoint_state(model, model.state_dict()), reward_model_config(model, pad_token_id), Path(out_dir),
                  dtype=dtype)


def reward_model_config(model: RewardModel | HFRewardModel, pad_token_id: int) -> dict[str, Any]:
    """The HF config of the sequence-classification layout (`num_labels: 1`, `pad_token_id`), which transformers
    and vLLM read to score at the rightmost non-pad token."""
    return {
        **model.hf_config,
        "architectures": [architecture(model.hf_config["model_type"], classifier=True)],
        "num_labels": 1,
        "id2label": {"0": "LABEL_0"},
        "label2id": {"LABEL_0": 0},
        "pad_token_id": int(pad_token_id),
    }


# --- a pretrained reward model, and the scale of its scores -----------------------------------


def as_messages(prompt: Any) -> list[dict[str, Any]]:
    """A prompts-split prompt (one user string or a message list) as a message list."""
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]


class PretrainedRewardModel:
    """A sequence classifier from a folder or hub id, scoring (prompt, completion) as its own chat template renders them.

    The text scored is the template applied to the prompt's messages plus the completion as the assistant's
    turn, tokenized without added special tokens (the template writes them), exactly as TRL scores a
    reward model among its `reward_funcs`. The score is the head at the last token.
    """

    def __init__(self, source: str | os.PathLike, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
        self.folder = resolve_model_source(source)
        problem = sequence_classifier_problem(read_hf_config(self.folder), str(self.folder / "config.json"))
        if problem:
            raise CheckpointError(problem)
        self.model = load_reward_model(self.folder, device, dtype, backend="native").eval()  # as the dry run checks it
        self.tokenizer = Tokenizer(self.folder)
        if not self.tokenizer.chat_template:
            raise CheckpointError(f"{self.folder}: the reward model's tokenizer has no chat template to render "
                                  "a prompt and its completion with")

    def texts(self, prompts: Sequence[Any], completions: Sequence[str]) -> list[str]:
        """The conversations scored: each prompt's messages, then its completion as the assistant's turn."""
        return [str(self.tokenizer.apply_chat_template([*as_messages(p), {"role": "assistant", "content": c}]))
                for p, c in zip(prompts, completions, strict=True)]

    def score(self, prompts: Sequence[Any], completions: Sequence[str], batch_size: int = 64) -> list[float]:
        """One score per (prompt, completion); identical conversations are scored once (so their scores are equal)."""
        texts = self.texts(prompts, completions)
        unique = list(dict.fromkeys(texts))
        scores = dict(zip(unique, score_sequences(self.model, self.tokenizer.encode_batch(unique),
                                                  self.tokenizer.pad_id, batch_size)))
        return [scores[t] for t in texts]


def normalize_scores(scores: Sequence[float], group_size: int, how: str) -> list[float]:
    """`reward_model.normalize`: `group` standardizes each run of `group_size` scores (one prompt's samples) to
    mean 0 and (population) standard deviation 1, a group without spread to 0; `none` keeps the raw scores.

    A reward model's scores have an arbitrary offset and scale (Bradley-Terry is blind to a shift, and each
    model has its own spread), so raw scores weigh differently for every model; standardized per group, a
    weight means "that many within-prompt standard deviations" for any model. A prompt's own samples only:
    the value of a sample does not depend on the rest of the batch, the data-parallel split or sync/async
    collection, and the reward stage and GRPO compute the same numbers. GRPO's advantages are group-relative
    anyway, so the mean removed is one they remove too.
    """
    if how not in RM_NORMALIZE:
        raise ValueError(f"reward_model.normalize: {how!r}; allowed: {', '.join(RM_NORMALIZE)}")
    if how == "none":
        return [float(s) for s in scores]
    if group_size < 1 or len(scores) % group_size:
        raise ValueError(f"{len(scores)} scores do not split into groups of {group_size}")
    out: list[float] = []
    for start in range(0, len(scores), group_size):
        group = torch.tensor(scores[start : start + group_size], dtype=torch.float64)
        std = float(group.std(unbiased=False)) if len(group) > 1 else 0.0
        out += [0.0] * len(group) if std < 1e-6 else ((group - group.mean()) / std).tolist()
    return out
