"""Multi-turn episodes as token-in/token-out trajectories.

The model's tokens are kept exactly as sampled; after each model turn the environment's reply is appended as
the chat template renders it after that turn, and nothing earlier is ever re-tokenized, so the trained tokens are
the sampled ones and the sampler's log-probs stay theirs. `mask` marks the model's tokens (the loss and the
importance weights cover only them). The template's text between the model's end-of-turn token and the next
turn (the newline ChatML writes after `<|im_end|>`) is the environment's, so the trajectory decodes to the
template's rendering of the conversation.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from posttrain.envs import load_environment
from posttrain.envs.base import Environment, Message
from posttrain.envs.tool_calls import parse_assistant
from posttrain.generation.backend import GenerationBackend
from posttrain.generation.sampler import SamplingParams
from posttrain.tokenizer import Tokenizer


@dataclass(frozen=True)
class EpisodeSettings:
    """The `environment` section: which environment class runs each episode, with what caps."""

    fn: str
    max_turns: int
    max_tokens: int
    args: tuple[tuple[str, Any], ...] = ()  # `environment.args`, as items (the spec stays hashable)
    workdir: str | None = None

    @classmethod
    def from_config(cls, section: Mapping[str, Any], workdir: str | None) -> EpisodeSettings | None:
        """The settings of an `environment` config section; None when it names no environment."""
        if not section.get("fn"):
            return None
        return cls(section["fn"], int(section["max_turns"]), int(section["max_tokens"]),
                   tuple(sorted(dict(section.get("args") or {}).items())), workdir)

    def load(self) -> type[Environment]:
        return load_environment(self.fn, self.workdir)

    def run(self, backend: GenerationBackend, tok: Tokenizer, params: SamplingParams,
            examples: Sequence[Mapping[str, Any]], seed: int, cls: type[Environment] | None = None) -> list[Trajectory]:
        """One episode per row of `examples`, each in a fresh environment (`cls`: the class, if loaded already)."""
        cls = cls or self.load()
        args = dict(self.args)
        return run_episodes(backend, tok, params, [cls(e, **args) for e in examples], seed, self.max_turns,
                            self.max_tokens)


class TemplateError(ValueError):
    """The chat template renders a conversation so that the next turn does not extend the one before it."""


@dataclass
class Trajectory:
    """One episode: the prompt's ids, then every token after it (the model's and the environment's)."""

    prompt_ids: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # the sampler's, 0.0 on the environment's tokens
    mask: list[bool] = field(default_factory=list)  # True: sampled by the model
    messages: list[Message] = field(default_factory=list)
    opening: int = 0  # how many of `messages` the environment opened with (the prompt)
    tools: Any = None  # the tool schemas the template rendered the episode with
    env_reward: float = 0.0
    turns: int = 0
    tool_calls: int = 0
    invalid_tool_calls: int = 0
    finish_reason: str = "stop"  # stop: the environment ended it; length: a token cap; turns: the turn cap
    done: bool = False

    def counts(self) -> dict[str, float]:
        """Turns, tool calls and malformed tool calls (what the step metrics and the evaluation average)."""
        return {"turns": self.turns, "tool_calls": self.tool_calls, "invalid_tool_calls": self.invalid_tool_calls}

    @property
    def final_text(self) -> str:
        """The model's last message's text: what the verifiers score."""
        last = next((m for m in reversed(self.messages) if m["role"] == "assistant"), None)
        return "" if last is None else str(last.get("content", ""))


def _extension(tok: Tokenizer, before: Sequence[Message], after: Sequence[Message], tools: Any,
               eos_text: str | None) -> str:
    """The template's text that follows the model's sampled turn: what `after` adds to `before` (which ends with
    the model's message), plus whatever the template writes after the model's end-of-turn token."""
    head = str(tok.apply_chat_template(before, tools=tools))
    full = str(tok.apply_chat_template(after, add_generation_prompt=True, tools=tools))
    if not full.startswith(head):
        raise TemplateError("the chat template renders the conversation with an environment turn so that it does not "
                            "start with the conversation before it; multi-turn episodes need a template whose turns "
                            "extend each other")
    tail = ""
    if eos_text and eos_text in head:
        tail = head[head.rindex(eos_text) + len(eos_text):]
    return tail + full[len(head):]


def run_episodes(backend: GenerationBackend, tok: Tokenizer, params: SamplingParams,
                 environments: Sequence[Environment], seed: int, max_turns: int, max_tokens: int) -> list[Trajectory]:
    """Every environment's episode, all turns batched across the active ones; deterministic for (weights, seed).

    A turn samples at most `params.max_new_tokens` and the episode at most `max_tokens` after its prompt (model
    and environment tokens together); it ends when the environment says so, at `max_turns` model turns, or when a
    turn is cut by a cap.
    """
    tools = [env.tools() for env in environments]
    messages = [env.messages() for env in environments]
    trajectories = [Trajectory(prompt_ids=list(tok.apply_chat_template(m, add_generation_prompt=True, tools=t,
                                                                          tokenize=True)), messages=list(m),
                               opening=len(m), tools=t)
                    for m, t in zip(messages, tools)]
    eos = set(params.stop_token_ids)
    for turn in range(max_turns):
        active = [i for i, t in enumerate(trajectories) if not t.done]
        if not active:
            break
        budget = {i: max_tokens - len(trajectories[i].tokens) for i in active}
        width = max(1, min(params.max_new_tokens, max(budget.values())))
        turn_params = SamplingParams(max_new_tokens=width, temperature=params.temperature, top_k=params.top_k,
                                     top_p=params.top_p, stop_token_ids=params.stop_token_ids)
        out = backend.generate([trajectories[i].prompt_ids + trajectories[i].tokens for i in active], turn_params,
                               (seed + turn * 1_000_003) % 2**63)  # turn 0: the single-turn seed
        for slot, i in enumerate(active):
            traj, env = trajectories[i], environments[i]
            sampled, logprobs = out.tokens[slot][: budget[i]], out.logprobs[slot][: budget[i]]
            traj.tokens += sampled
            traj.logprobs += logprobs
            traj.mask += [True] * len(sampled)
            traj.turns += 1
            ended = bool(sampled) and sampled[-1] in eos
            message, invalid = parse_assistant(tok.decode(sampled[:-1] if ended else sampled))
            traj.messages.append(message)
            traj.tool_calls += len(message.get("tool_calls", []))
            traj.invalid_tool_calls += invalid
            if not ended:  # cut by a cap: no complete turn to answer
                traj.finish_reason, traj.done = "length", True
                continue
            reply = env.step(message)
            traj.env_reward += float(reply.reward)
            if reply.done or not reply.messages:
                traj.finish_reason, traj.done = "stop", True
                continue
            if turn == max_turns - 1:  # no model turn would follow the reply
                traj.finish_reason, traj.done = "turns", True
                continue
            eos_text = tok.decode([sampled[-1]], skip_special_tokens=False)
            text = _extension(tok, traj.messages, traj.messages + reply.messages, tools[i], eos_text)
            traj.messages += reply.messages
            added = tok.encode(text)
            if len(traj.tokens) + len(added) >= max_tokens:
                traj.finish_reason, traj.done = "length", True
                continue
            traj.tokens += added
            traj.logprobs += [0.0] * len(added)
            traj.mask += [False] * len(added)
    for traj in trajectories:
        if not traj.done:
            traj.finish_reason, traj.done = "turns", True
    return trajectories



def scored_rows(trajectories: Sequence[Trajectory], examples: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The rows the verifiers score episodes with: each with its episode's `env_reward`."""
    return [{**e, "env_reward": t.env_reward} for t, e in zip(trajectories, examples)]


def episode_metrics(counts: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Turns and tool calls per episode, and the share of tool-call blocks that did not parse, from episodes'
    `Trajectory.counts()`."""
    calls = sum(c["tool_calls"] + c["invalid_tool_calls"] for c in counts)
    return {"turns_mean": sum(c["turns"] for c in counts) / len(counts),
            "tool_calls_mean": sum(c["tool_calls"] for c in counts) / len(counts),
            "invalid_tool_call_rate": sum(c["invalid_tool_calls"] for c in counts) / calls if calls else 0.0}
