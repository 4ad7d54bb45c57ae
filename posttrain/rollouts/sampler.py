"""Prompts in, `Sample`s out: the one place that decides between a single completion and a multi-turn episode.

Every caller gets the same record whatever ran: the ids the model was prompted with, every token after them
with the sampler's log-probs, why it ended, and the text the verifiers score. With an environment, the prompt
is the one the environment opened with (not the data row's), the tokens are the whole episode (the model's and
the environment's, `mask` telling them apart), and the scored text is the model's last message, with the
environment's reward in the row it is scored with (the `environment` verifier).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from tqdm.auto import tqdm

from posttrain.envs.base import Environment, Message
from posttrain.envs.episodes import EpisodeSettings, Trajectory
from posttrain.generation.backend import GenerationBackend
from posttrain.generation.sampler import SamplingParams
from posttrain.tokenizer import Tokenizer

GENERATION_BATCH = 64  # sequences per native generate() call: what a stage samples in one call


@dataclass
class Sample:
    """One completion, or one episode, as sampled."""

    prompt_ids: list[int]  # what the model was prompted with
    tokens: list[int]  # every token after the prompt, up to and including the last stop token
    logprobs: list[float]  # the sampler's log-prob of each token (0.0 on an environment's tokens)
    finish_reason: str  # stop | length, and for an episode turns (the turn cap)
    text: str  # what the verifiers score: the completion, or the episode's last model message
    mask: list[bool] | None = None  # an episode's: True where the model sampled (only those are trained on)
    messages: list[Message] | None = None  # an episode's conversation, the environment's opening included
    opening: int | None = None  # how many of `messages` the environment opened with (the episode's prompt)
    tools: Any = None  # the tool schemas an episode was rendered with
    env_reward: float | None = None  # an episode's reward from its environment
    counts: dict[str, float] | None = None  # an episode's turns, tool calls and malformed tool calls

    @classmethod
    def of_episode(cls, episode: Trajectory) -> Sample:
        return cls(episode.prompt_ids, episode.tokens, episode.logprobs, episode.finish_reason, episode.final_text,
                   episode.mask, episode.messages, episode.opening, episode.tools, episode.env_reward, episode.counts())

    @property
    def is_episode(self) -> bool:
        return self.mask is not None

    def scored_row(self, example: Mapping[str, Any]) -> dict[str, Any]:
        """The row the verifiers score this sample with: an episode's carries its `env_reward`."""
        return {**example, "env_reward": self.env_reward} if self.is_episode else dict(example)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class Sampler:
    """A backend and its tokenizer, and with `episodes` (the `environment` section) the environment each sample
    runs in. The backend may be given as a function that builds it, called when the first sample is drawn (vLLM
    takes a while to start; a resumed stage with every call done never starts it)."""

    def __init__(self, backend: GenerationBackend | Callable[[], GenerationBackend], tokenizer: Tokenizer,
                 episodes: EpisodeSettings | None = None):
        self._backend = backend
        self.tokenizer, self.episodes = tokenizer, episodes
        self.environment: type[Environment] | None = episodes.load() if episodes else None

    @property
    def backend(self) -> GenerationBackend:
        if not hasattr(self._backend, "generate"):
            self._backend = self._backend()  # type: ignore[operator]
        return self._backend  # type: ignore[return-value]

    def sample(self, prompt_ids: Sequence[Sequence[int]], examples: Sequence[Mapping[str, Any]] | None,
               params: SamplingParams, seed: int) -> list[Sample]:
        """One sample per (prompt, example), in order; deterministic for (weights, prompts, seed). An episode
        starts from its example (the environment renders the prompt), a completion from its prompt ids (its
        example may be left out: None)."""
        if examples is None and self.episodes is not None:
            raise ValueError("an episode starts from its row: examples are needed with an environment")
        if examples is not None and len(prompt_ids) != len(examples):
            raise ValueError(f"{len(prompt_ids)} prompts but {len(examples)} examples")
        if not prompt_ids:
            return []
        if self.episodes is not None and examples is not None:
            episodes = self.episodes.run(self.backend, self.tokenizer, params, examples, seed, self.environment)
            return [Sample.of_episode(e) for e in episodes]
        out = self.backend.generate([list(p) for p in prompt_ids], params, seed)
        texts = self.tokenizer.decode_batch(out.tokens)
        return [Sample(list(p), t, lp, r, text)
                for p, t, lp, r, text in zip(prompt_ids, out.tokens, out.logprobs, out.finish_reasons, texts)]


def sample_in_calls(sampler: Sampler, prompt_ids: Sequence[Sequence[int]], examples: Sequence[Mapping[str, Any]],
                    params: SamplingParams, seed: int, per_call: int, desc: str,
                    done: Mapping[int, list[dict[str, Any]]] | None = None,
                    after_call: Callable[[int, list[Sample]], None] | None = None) -> list[Sample]:
    """`sampler.sample` over `per_call` prompts at a time, call c seeded `seed + c` (so a call's samples do not
    depend on the calls before it), with a progress bar. `done`: calls already sampled (by number, as
    `Sample.to_json` lists), skipped; `after_call(c, samples)` runs after each call sampled here (a resumable
    log, a stop check)."""
    samples: list[Sample] = []
    starts = range(0, len(prompt_ids), per_call)
    with tqdm(total=len(prompt_ids), desc=desc, unit="sample", dynamic_ncols=True, mininterval=1.0) as bar:
        for call, start in enumerate(starts):
            if done is not None and call in done:
                part = [Sample(**s) for s in done[call]]
            else:
                part = sampler.sample(prompt_ids[start : start + per_call], examples[start : start + per_call],
                                      params, seed + call)
                if after_call is not None:
                    after_call(call, part)
            samples += part
            bar.update(len(part))
    return samples
