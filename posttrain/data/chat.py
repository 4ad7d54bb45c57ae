"""Chat formatting with the tokenizer's template, and which tokens are trained (the loss mask).

The mask is derived from the rendered text, not from assumptions about the template: the chat is
rendered once, and each assistant message's character span is found by rendering the prefix before
it (with the generation prompt) and the prefix through it. A token is trained when its character
span overlaps an assistant span. Templates whose prefixes are not prefixes of the whole chat (e.g.
ones that rewrite earlier turns) fall back to locating the message content in the rendered text.
Text after the end-of-turn token (ChatML's trailing newline) is not trained. Tool schemas reach
the template as `tools`, and messages carry their tool calls and reasoning for it to render;
`render_check` tells whether it does. Plain-text rows (TRL's standard format) skip the template
(`tokenize_texts`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jinja2

from posttrain.data.sources import DataError
from posttrain.losses.chunked import IGNORE_INDEX
from posttrain.tokenizer import Tokenizer

LOSS_MASKS = ("assistant", "all", "last_turn")

Messages = Sequence[dict[str, Any]]
Tools = Sequence[dict[str, Any]] | None  # tool schemas, passed to the template as `tools` (None: none)


def _render_or_none(tok: Tokenizer, messages: Messages, add_generation_prompt: bool, tools: Tools = None) -> str | None:
    try:
        return tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools)
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


def assistant_spans(tok: Tokenizer, messages: Messages, tools: Tools = None) -> tuple[str, list[tuple[int, int, int]]]:
    """The rendered chat and (message index, char start, char end) of every assistant message."""
    full = tok.apply_chat_template(messages, tools=tools)
    stops = tok.stop_strings
    spans, cursor = [], 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render_or_none(tok, messages[:i], add_generation_prompt=True, tools=tools)
        through = _render_or_none(tok, messages[: i + 1], add_generation_prompt=False, tools=tools)
        if before is not None and through is not None and len(before) >= cursor \
                and full.startswith(through) and through.startswith(before) and len(through) > len(before):
            start, end = len(before), _end_of_turn(full, len(before), len(through), stops)
        else:
            if "tool_calls" in message or "reasoning_content" in message:
                # Tool calls or reasoning render where only the template knows: no content to search for.
                raise DataError(f"chat template renders message {i} differently in a prefix of the chat, and the message "
                                "holds more than its text (tool calls, reasoning); cannot locate the assistant tokens")
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
    tok: Tokenizer, chats: Sequence[Messages], loss_mask: str = "assistant", first_trained_message: int | Sequence[int] = 0,
    tools: Sequence[Tools] | None = None,
) -> list[tuple[list[int], list[bool]]]:
    """Token ids of each rendered chat and, per token, whether it is a training target.

    `loss_mask`: `assistant` (every assistant message), `last_turn` (the last one), `all` (every
    token). Only assistant messages at index >= `first_trained_message` (one for all chats, or one
    per chat) count: preference pairs train the completion, never the prompt. `tools`: each chat's
    tool schemas (None: none), rendered by the template.
    """
    if loss_mask not in LOSS_MASKS:
        raise ValueError(f"loss_mask must be one of {LOSS_MASKS}, got {loss_mask!r}")
    firsts = [first_trained_message] * len(chats) if isinstance(first_trained_message, int) else first_trained_message
    tools = [None] * len(chats) if tools is None else tools
    rendered = [
        (tok.apply_chat_template(messages, tools=row_tools), []) if loss_mask == "all"
        else assistant_spans(tok, messages, row_tools)
        for messages, row_tools in zip(chats, tools)
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


def tokenize_texts(
    tok: Tokenizer, prompts: Sequence[str], completions: Sequence[str], loss_mask: str = "assistant"
) -> list[tuple[list[int], list[bool]]]:
    """Plain text (TRL's standard format): ids of prompt + completion + eos, and the completion's tokens trained.

    The text is tokenized as `transformers` tokenizes it (`tokenizer(text)`: the tokenizer's own
    special tokens, such as a bos, around it), and the eos token is appended unless the text ends
    with it. A token is trained when its characters overlap the completion (`loss_mask: all`:
    every token); the eos is trained. A language-modeling row is a completion with an empty prompt.
    """
    if loss_mask not in LOSS_MASKS:
        raise ValueError(f"loss_mask must be one of {LOSS_MASKS}, got {loss_mask!r}")
    eos = tok.eos_id
    if eos is None:
        raise DataError(f"{tok.folder}: plain-text rows (render: raw, or a text column) end with the eos token, "
                        "and the tokenizer has none (eos_token in tokenizer_config.json)")
    texts = [p + c for p, c in zip(prompts, completions)]
    out = []
    for prompt, text, (plain, offsets) in zip(prompts, texts, tok.encode_batch_with_offsets(texts)):
        ids = tok.encode(text, add_special_tokens=True)
        lead = next((i for i in range(len(ids) - len(plain) + 1) if ids[i:i + len(plain)] == plain), None)
        if lead is None:
            raise DataError(f"{tok.folder}: the tokenizer's special tokens change the ids of the text {text[:40]!r}")
        start = 0 if loss_mask == "all" else len(prompt)
        mask = [loss_mask == "all"] * lead + _mask_from_offsets(offsets, [(start, len(text))] if text else [])
        mask += [True] * (len(ids) - len(mask))  # special tokens the tokenizer appends close the completion
        if not ids or ids[-1] != eos:
            ids, mask = [*ids, eos], [*mask, True]
        out.append((ids, mask))
    return out


def render_check(tok: Tokenizer, messages: Messages, tools: Tools = None,
                 add_generation_prompt: bool = False) -> tuple[tuple[int | str | None, str] | None, int]:
    """Whether the chat template renders a chat with everything it holds: (problem, reasoning messages not rendered).

    The problem is None, or (where: a message index, "tools", or None for the whole chat; what is
    wrong): the template raises, or renders a message the same without its tool calls, or the chat
    the same without its tools (it does not support tools). Reasoning (`reasoning_content`) the template leaves out is counted, not refused:
    templates such as Qwen3's render it only for the turns after the last user message, by design.
    """
    try:
        full = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools)
    except jinja2.TemplateError as err:
        calls = next((j for j, m in enumerate(messages) if "tool_calls" in m), None)
        if calls is not None:
            return (calls, f"has tool calls, and the chat template cannot render them ({type(err).__name__}: {err}): "
                           "use a model whose chat template supports tools"), 0
        return (None, f"the chat template cannot render it ({type(err).__name__}: {err})"), 0
    for j, message in enumerate(messages):
        if "tool_calls" in message:
            plain = {k: v for k, v in message.items() if k != "tool_calls"}
            plain.setdefault("content", "")
            if _render_or_none(tok, [*messages[:j], plain, *messages[j + 1:]], add_generation_prompt, tools) == full:
                return (j, "has tool calls, and the chat template does not render them (it renders the message the same "
                           "without them): use a model whose chat template supports tools"), 0
    if tools and _render_or_none(tok, messages, add_generation_prompt, None) == full:
        return ("tools", "the chat template does not render tools (it renders the chat the same without them): use a "
                      "model whose chat template supports tools"), 0
    unrendered = 0
    for j, message in enumerate(messages):
        if message.get("reasoning_content"):
            plain = {k: v for k, v in message.items() if k != "reasoning_content"}
            unrendered += _render_or_none(tok, [*messages[:j], plain, *messages[j + 1:]], add_generation_prompt, tools) == full
    return None, unrendered
