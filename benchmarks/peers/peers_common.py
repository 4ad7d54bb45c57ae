"""What both sides of the posttrain-vs-TRL benchmark share: the starting model, the data, the settings.

Everything is built locally and seeded. The model is a random-init Qwen3-architecture network
saved once as an HF folder (`posttrain.model_files.save_hf_model`); posttrain and `transformers`
both load that folder, so both start from identical weights. The tokenizer is word-level: token
`t<i>` is id i, so the text that TRL's DPO and GRPO paths tokenize maps to exactly the ids
posttrain trains on (ids 0, 1, 2 are pad, eos, unk). The data are synthetic token sequences whose
lengths follow a skewed (lognormal, long-tailed) distribution.

Useful tokens, the throughput numerator, counted the same way on both sides: the non-pad tokens
of the input sequences a timed training step processes. SFT: the documents' tokens (prompt and
response). DPO: prompt + chosen and prompt + rejected. GRPO: prompt + generated completion of
every sampled sequence. Padding that either side's batching adds is not counted. Tokens/s divides
them by the wall time from the end of the last warm-up step to the end of the last timed step, so
data loading, generation, the optimizer step and logging are all inside the window.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

BENCHMARKS = Path(__file__).resolve().parent.parent
if str(BENCHMARKS) not in sys.path:  # the shared benchmark helpers (_memory, ...) and the groups' scripts (sft_memory, ...)
    sys.path[:0] = [str(BENCHMARKS), *(str(d) for d in sorted(BENCHMARKS.glob("[a-z]*/")))]

from _documents import skewed_documents  # noqa: E402

PAD_ID, EOS_ID, UNK_ID = 0, 1, 2
FIRST_WORD_ID = 3
Documents = tuple[list[np.ndarray], list[np.ndarray]]  # token ids and aligned labels, one array per document
WORKLOADS = ("sft_padded", "sft_packed", "dpo", "grpo")
REWARD_SPEC = "peers_common:parity_reward"  # a posttrain verifier spec (`module:function`)
_WORD = re.compile(r"\bt(\d+)\b")


@dataclass(frozen=True)
class Settings:
    """One benchmark configuration, identical for both sides."""

    vocab: int = 4096
    hidden: int = 256
    layers: int = 4
    seq: int = 256  # SFT row length; longest DPO sequence
    rows: int = 4  # SFT rows per step
    pairs: int = 2  # DPO pairs per step
    prompts: int = 2  # GRPO prompts per step
    group: int = 4  # GRPO completions per prompt
    max_new_tokens: int = 32
    prompt_median: int = 24  # GRPO prompt length median (lognormal)
    warmup: int = 1
    steps: int = 3
    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    dpo_beta: float = 0.1
    clip_eps: float = 0.2
    temperature: float = 1.0
    seed: int = 0

    @property
    def total_steps(self) -> int:
        return self.warmup + self.steps

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def model_config(s: Settings) -> dict[str, Any]:
    """HF config of the benchmark model: Qwen3 architecture (q/k norms, GQA, tied embeddings)."""
    heads = max(s.hidden // 32, 1)
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_act": "silu",
        "vocab_size": s.vocab,
        "hidden_size": s.hidden,
        "intermediate_size": 3 * s.hidden,
        "num_hidden_layers": s.layers,
        "num_attention_heads": heads,
        "num_key_value_heads": max(heads // 4, 1),
        "head_dim": 32,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000.0,
        "attention_bias": False,
        "initializer_range": 0.02,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "pad_token_id": PAD_ID,
        "eos_token_id": EOS_ID,
    }


def build_model_folder(hf_config: Mapping[str, Any], out: Path, seed: int = 0) -> Path:
    """Random-init the model once (seeded), save it as an HF folder with the word-level tokenizer."""
    import torch

    from posttrain.model_files import save_hf_model
    from posttrain.models import Transformer

    torch.manual_seed(seed)
    model = Transformer(dict(hf_config))
    save_hf_model(model.state_dict(), dict(hf_config), out)
    save_tokenizer(int(hf_config["vocab_size"]), out)
    return out


def save_tokenizer(vocab: int, out: Path) -> None:
    """Word-level tokenizer over `<pad> <eos> <unk> t3 ... t<vocab-1>` (whitespace-split), saved as transformers does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": PAD_ID, "<eos>": EOS_ID, "<unk>": UNK_ID}
    words.update({f"t{i}": i for i in range(FIRST_WORD_ID, vocab)})
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with single spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    fast.save_pretrained(str(out))


def text(ids: list[int] | np.ndarray) -> str:
    """The word-level text of token ids (the inverse of the benchmark tokenizer)."""
    return " ".join("<eos>" if int(i) == EOS_ID else f"t{int(i)}" for i in ids)


def parity_reward(completion: str, example: Mapping[str, Any]) -> float:
    """Verifiable reward: the share of completion tokens with an even id (0 for an empty completion).

    A posttrain verifier (``fn(completion_text, example) -> float``); TRL's reward function calls it too.
    """
    ids = [int(m) for m in _WORD.findall(completion)]
    return sum(i % 2 == 0 for i in ids) / len(ids) if ids else 0.0


# ----- data -----

def sft_documents(s: Settings, n: int) -> Documents:
    """`n` documents (lengths lognormal, median seq/8) and their aligned labels (first quarter is prompt).

    Labels follow posttrain's convention: shifted left by one, -100 on prompt and on the last token.
    """
    return skewed_documents(n, s.seq, s.vocab, seed=s.seed)


def unshifted_labels(ids: np.ndarray, labels: np.ndarray) -> list[int]:
    """The same loss tokens in transformers' convention (label at the token's own position; the model shifts)."""
    out = np.full(len(ids), -100, dtype=np.int64)
    out[1:] = labels[:-1]
    return out.tolist()


def _lognormal_lengths(rng: np.random.Generator, n: int, median: float, low: int, high: int) -> np.ndarray:
    return np.clip(rng.lognormal(mean=np.log(median), sigma=0.7, size=n).astype(int), low, high)


def preference_pairs(s: Settings, n: int) -> list[tuple[list[int], list[int], list[int]]]:
    """`n` (prompt, chosen, rejected) id lists; completions end with eos; prompt + completion <= seq."""
    rng = np.random.default_rng(s.seed + 1)
    prompt_len = _lognormal_lengths(rng, n, s.seq / 4, 4, s.seq // 2)
    pairs = []
    for i in range(n):
        room = s.seq - int(prompt_len[i])
        lengths = _lognormal_lengths(rng, 2, s.seq / 6, 2, room)
        prompt = rng.integers(FIRST_WORD_ID, s.vocab, size=int(prompt_len[i])).tolist()
        chosen, rejected = (rng.integers(FIRST_WORD_ID, s.vocab, size=int(k) - 1).tolist() + [EOS_ID] for k in lengths)
        pairs.append((prompt, chosen, rejected))
    return pairs


def grpo_prompts(s: Settings, n: int) -> list[list[int]]:
    """`n` prompt id lists, lengths lognormal around `prompt_median`."""
    rng = np.random.default_rng(s.seed + 2)
    lengths = _lognormal_lengths(rng, n, s.prompt_median, 4, 4 * s.prompt_median)
    return [rng.integers(FIRST_WORD_ID, s.vocab, size=int(k)).tolist() for k in lengths]


def sft_document_count(s: Settings) -> int:
    """Documents to build: enough for every step of the padded run and, packed ~5 to a row, of the packed run."""
    return max(s.total_steps * s.rows * 8, 64)
