"""Chat formatting with the tokenizer's template, and which tokens are trained (the loss mask).

The mask is derived from the rendered text, not from assumptions about the template: the chat is
rendered once, and each assistant message's character span is found by rendering the prefix before
it (with the generation prompt) and the prefix through it. A token is trained when its character
span overlaps an assistant span. Templates whose prefixes are not prefixes of the whole chat (e.g.
ones that rewrite earlier turns) fall back to locating the message content in the rendered text.
Text after the end-of-turn token (ChatML's trailing newline) is not trained.
"""

from __future__ import annotations

from collections.abc import Sequence

import jinja2

from posttrain.data.sources import DataError
from posttrain.losses.chunked import IGNORE_INDEX
from posttrain.tokenizer import Tokenizer

LOSS_MASKS = ("assistant", "all", "last_turn")

Messages = Sequence[dict[str, str]]


def _render_or_none(tok: Tokenizer, messages: Messages, add_generation_prompt: bool) -> str | None:
    try:
        return tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    except jinja2.TemplateError:  # e.g. a template that indexes messages[0] of an empty prefix
        return None


def _end_of_turn(full: str, start: int, end: int, stops: Sequence[str]) -> int:
    """Cut a span right after the first end-of-turn string that closes it, if one does."""
    best = end
    for stop in stops:
        at = full.find(stop, start, end)
        if at >= 0:
            best = min(best, at + len(stop))
    return best


def assistant_spans(tok: Tokenizer, messages: Messages) -> tuple[str, list[tuple[int, int, int]]]:
    """The rendered chat and (message index, char start, char end) of every assistant message."""
    full = tok.apply_chat_template(messages)
    stops = tok.stop_strings
    spans, cursor = [], 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render_or_none(tok, messages[:i], add_generation_prompt=True)
        through = _render_or_none(tok, messages[: i + 1], add_generation_prompt=False)
        if before is not None and through is not None and len(before) >= cursor \
                and full.startswith(through) and through.startswith(before) and len(through) > len(before):
            start, end = len(before), _end_of_turn(full, len(before), len(through), stops)
        else:
            start = full.find(message["content"], cursor)
            if start < 0:
                raise DataError(f"chat template drops the content of message {i}; cannot locate the assistant tokens")
            end = start + len(message["content"])
            after = full[end:]
            for stop in stops:  # train the end-of-turn token that follows the content
                if after.lstrip(" ").startswith(stop):
                    end += after.index(stop) + len(stop)
                    break
        spans.append((i, start, end))
        cursor = end
    return full, spans


def _mask_from_offsets(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> list[bool]:
    """True for every token whose character span overlaps one of `spans` (both in text order)."""
    mask, k = [False] * len(offsets), 0
    for t, (tok_start, tok_end) in enumerate(offsets):
        while k < len(spans) and tok_start >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        mask[t] = tok_end > spans[k][0]
    return mask


def tokenize_chats(
    tok: Tokenizer, chats: Sequence[Messages], loss_mask: str = "assistant", first_trained_message: int | Sequence[int] = 0
) -> list[tuple[list[int], list[bool]]]:
    """Token ids of each rendered chat and, per token, whether it is a training target.

    `loss_mask`: `assistant` (every assistant message), `last_turn` (the last one), `all` (every
    token). Only assistant messages at index >= `first_trained_message` (one for all chats, or one
    per chat) count: preference pairs train the completion, never the prompt.
    """
    if loss_mask not in LOSS_MASKS:
        raise ValueError(f"loss_mask must be one of {LOSS_MASKS}, got {loss_mask!r}")
    firsts = [first_trained_message] * len(chats) if isinstance(first_trained_message, int) else first_trained_message
    rendered = [
        (tok.apply_chat_template(messages), []) if loss_mask == "all" else assistant_spans(tok, messages)
        for messages in chats
    ]
    encoded = tok.encode_batch_with_offsets([text for text, _ in rendered])
    out = []
    for (_, spans), (ids, offsets), first in zip(rendered, encoded, firsts):
        if loss_mask == "all":
            out.append((ids, [True] * len(ids)))
            continue
        kept = [(s, e) for i, s, e in spans if i >= first]
        out.append((ids, _mask_from_offsets(offsets, kept[-1:] if loss_mask == "last_turn" else kept)))
    return out


def tokenize_chat(
    tok: Tokenizer, messages: Messages, loss_mask: str = "assistant", first_trained_message: int = 0
) -> tuple[list[int], list[bool]]:
    """`tokenize_chats` for one chat."""
    return tokenize_chats(tok, [messages], loss_mask, first_trained_message)[0]


def shifted_labels(ids: Sequence[int], mask: Sequence[bool]) -> list[int]:
    """labels[t] = ids[t + 1] where token t + 1 is trained, else -100 (and at the last position)."""
    labels = [ids[t + 1] if mask[t + 1] else IGNORE_INDEX for t in range(len(ids) - 1)]
    labels.append(IGNORE_INDEX)
    return labels
