"""GRPO plumbing without Ray: staleness buffer, training tensors vs the sampler's log-probs, prompt feed,
rollout workers and their version checks, and the async dispatcher driven by an in-process stand-in for Ray."""

from __future__ import annotations

import json

import pytest
import torch

from posttrain.data.loader import Batches, prompt_collate
from posttrain.data.store import Split
from posttrain.generation.backend import NativeBackend
from posttrain.generation.sampler import SamplingParams
from posttrain.losses.chunked import IGNORE_INDEX
from posttrain.losses.logprobs import token_logprobs
from posttrain.models import Transformer, preset_config
from posttrain.rl.batch import advantages, micro_batches
from posttrain.rl.buffer import StalenessBuffer, StepRollouts
from posttrain.rl.sync_collector import PromptFeed, SyncCollector, rollout_seed
from posttrain.rl.ray_collector import LOCAL_RAY_ENV, RayCollector, import_ray, split_groups
from posttrain.rl.rollout import PromptBatch, RolloutGroup, RolloutWorker, rollout_stats
from posttrain.rollouts import RewardFunction, Sampler
from posttrain.tokenizer import train_bpe_tokenizer
from posttrain.workflow.schema import ConfigError, load_config

# --- staleness buffer -----------------------------------------------------------------------


def item(ticket: int, version: int) -> StepRollouts:
    return StepRollouts(ticket=ticket, version=version, payload=[ticket])


def test_buffer_hands_out_in_dispatch_order_and_waits_for_the_oldest():
    buf = StalenessBuffer(capacity=3, max_staleness=2)
    for t in (1, 2, 3):
        buf.reserve(t)
    assert buf.free_slots() == 0
    buf.put(item(3, 0))
    buf.put(item(2, 0))
    assert buf.take(trainer_version=0) is None  # ticket 1 still being generated
    buf.put(item(1, 0))
    assert [buf.take(0).ticket for _ in range(3)] == [1, 2, 3]
    assert buf.take(0) is None and buf.free_slots() == 3


def test_buffer_drops_batches_past_max_staleness_and_frees_their_slots():
    buf = StalenessBuffer(capacity=3, max_staleness=1)
    for t, v in ((1, 0), (2, 1), (3, 2)):
        buf.reserve(t)
        buf.put(item(t, v))
    got = buf.take(trainer_version=2)  # version 0 is 2 behind: dropped; version 1 is 1 behind: fresh
    assert got.ticket == 2 and buf.dropped == [(1, 0)]
    assert buf.free_slots() == 2
    assert buf.take(trainer_version=4) is None  # ticket 3 (version 2) is 2 behind version 4
    assert buf.dropped == [(1, 0), (3, 2)]


def test_buffer_refuses_overflow_unreserved_and_future_versions():
    buf = StalenessBuffer(capacity=1, max_staleness=0)
    buf.reserve(1)
    with pytest.raises(RuntimeError, match="full"):
        buf.reserve(2)
    with pytest.raises(RuntimeError, match="without a reserved slot"):
        buf.put(item(7, 0))
    buf.put(item(1, 3))
    with pytest.raises(RuntimeError, match="newer than the trainer"):
        buf.take(trainer_version=2)
    with pytest.raises(ValueError, match="max_staleness"):
        StalenessBuffer(capacity=1, max_staleness=-1)


# --- a tiny model, tokenizer and prompts --------------------------------------------------------

TEXTS = [f"Compute {a} + {b}. #### {a + b}" for a in range(30) for b in range(0, 30, 7)]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return train_bpe_tokenizer(TEXTS, vocab_size=300, out_dir=tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def model(tok):
    torch.manual_seed(0)
    hf = preset_config("tiny", tok.vocab_size, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)
    hf.update(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8)
    return Transformer(hf).eval()


def prompt_dataset(tok, n: int = 12) -> Split:
    rows = [{"a": a, "b": a + 3} for a in range(n)]
    return Split.from_columns({
        "prompt_ids": [tok.encode(f"Compute {r['a']} + {r['b']}.") for r in rows],
        "answer": [str(r["a"] + r["b"]) for r in rows],
        "task": ["arithmetic"] * n,
        "example": [json.dumps({"task": "arithmetic", "answer": str(r["a"] + r["b"]), "prompt": "p"}) for r in rows],
    })


def make_worker(model, tok, group_size=4, max_new_tokens=6, temperature=1.0) -> RolloutWorker:
    backend = NativeBackend(model, tok.pad_id, tok.decode)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, stop_token_ids=tok.eos_ids)
    return RolloutWorker(Sampler(backend, tok), params, group_size, RewardFunction(["task", "format"]))


def prompts(tok, n=3) -> PromptBatch:
    batch = prompt_collate(prompt_dataset(tok, n)[:n], list(range(n)))
    return PromptBatch.from_loader(batch)


# --- training tensors ------------------------------------------------------------------------------


def test_micro_batches_align_targets_and_generator_logprobs_with_the_trainer(model, tok):
    """The trainer's token log-probs at the batch's target positions equal the sampler's, token for token."""
    worker = make_worker(model, tok, temperature=0.7)
    groups = worker.collect(prompts(tok), seed=3)
    adv = advantages(groups, std_normalize=True)
    batches = micro_batches(groups, adv, size=5, pad_id=tok.pad_id)
    assert [len(b.advantages) for b in batches] == [5, 5, 2]
    rows = [(g.prompt_ids, c, lp) for g in groups for c, lp in zip(g.completions, g.logprobs)]
    seen = 0
    for b in batches:
        with torch.no_grad():
            trainer = token_logprobs(model(b.input_ids), model.lm_head, b.targets, temperature=0.7, num_chunks=2)
        assert torch.allclose(trainer, b.generator_logprobs, atol=1e-5)
        for i in range(len(b.advantages)):
            prompt, completion, _ = rows[seen + i]
            kept = b.targets[i][b.targets[i] != IGNORE_INDEX].tolist()
            assert kept == completion
            assert b.input_ids[i, : len(prompt) + len(completion)].tolist() == list(prompt) + list(completion)
            assert (b.input_ids[i, len(prompt) + len(completion):] == tok.pad_id).all()
        seen += len(b.advantages)
    assert torch.equal(torch.cat([b.advantages for b in batches]), adv)
    padded = micro_batches(groups, adv, size=5, pad_id=tok.pad_id, length_multiple=4)
    assert all(b.input_ids.shape[1] % 4 == 0 and torch.equal(b.mask.sum(), a.mask.sum()) for a, b in zip(batches, padded))


def test_advantages_are_group_relative_and_stats_count_flat_groups():
    def group(rewards):
        n = len(rewards)
        return RolloutGroup([1], {}, [[5]] * n, [[-1.0]] * n, ["stop"] * n, rewards, [r >= 1 for r in rewards], 0)

    groups = [group([1.0, 0.0, 0.0, 1.0]), group([0.0, 0.0, 0.0, 0.0])]
    adv = advantages(groups, std_normalize=False)
    assert adv.tolist() == [0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0, 0.0]
    stats = rollout_stats(groups)
    assert stats["pass_rate"] == 0.25 and stats["zero_signal_frac"] == 0.5 and stats["reward_mean"] == 0.25
    with pytest.raises(ValueError, match="one group size"):
        advantages([group([1.0, 0.0]), group([1.0, 0.0, 0.0])], std_normalize=False)


# --- prompt feed, workers, sync collector ------------------------------------------------------


def test_prompt_feed_resumes_where_the_consumed_steps_end(tok):
    def feed():
        return PromptFeed(Batches(prompt_dataset(tok), 4, prompt_collate, seed=5), seed=11)

    a = feed()
    drawn = [a.next() for _ in range(5)]
    state = a.state_after(2)  # steps 3..5 were drawn ahead (async) but not trained
    b = feed()
    b.load_state_dict(json.loads(json.dumps(state)))
    again = [b.next() for _ in range(3)]
    assert [w.step for w in again] == [3, 4, 5]
    assert [w.prompts.index for w in again] == [w.prompts.index for w in drawn[2:]]
    assert [w.seed for w in again] == [w.seed for w in drawn[2:]]
    assert len({rollout_seed(11, s, shard) for s in range(50) for shard in range(4)}) == 200


def test_worker_collect_is_seeded_and_versions_arrive_in_order(model, tok):
    worker = make_worker(model, tok)
    batch = prompts(tok, 2)
    a, b = worker.collect(batch, seed=7), worker.collect(batch, seed=7)
    assert [g.completions for g in a] == [g.completions for g in b]
    assert all(g.version == 0 and g.group_size == 4 and len(g.rewards) == 4 for g in a)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert worker.update_weights(state, 1) == 1 and worker.collect(batch, 7)[0].version == 1
    with pytest.raises(ValueError, match="one version at a time"):
        worker.update_weights(state, 3)
    with pytest.raises(ValueError, match="one version at a time"):
        worker.update_weights(state, 1)
    worker.start_at(state, 5)  # a resumed run jumps once, before any update
    assert worker.version == 5
    # A group of one has no relative advantage: the schema's minimum refuses it, in the dry run.
    with pytest.raises(ConfigError, match=r"grpo\.group_size"):
        load_config(overrides={"grpo": {"group_size": 1}})


def test_sync_collector_generates_with_the_trainers_version(model, tok):
    worker = make_worker(model, tok)
    feed = PromptFeed(Batches(prompt_dataset(tok), 3, prompt_collate, seed=0), seed=1)
    collector = SyncCollector(worker, feed)
    rollouts, wait_s = collector.next(trainer_version=0)
    assert rollouts.ticket == 1 and rollouts.version == 0 and len(rollouts.payload) == 3 and wait_s > 0
    with pytest.raises(RuntimeError, match="version"):
        collector.next(trainer_version=1)


def test_reward_function_needs_the_reward_model_it_is_told_to_use(tmp_path):
    with pytest.raises(FileNotFoundError, match="rm_weight"):
        RewardFunction(["task"], tmp_path / "rm", rm_weight=0.5)
    with pytest.raises(ValueError, match="at least one verifier"):
        RewardFunction([])


# --- the async dispatcher, with a stand-in for Ray that runs every call at once --------------------


class _Ref:
    def __init__(self, value):
        self.value = value


class _Method:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        return _Ref(self.fn(*[a.value if isinstance(a, _Ref) else a for a in args]))


class _Actor:
    def __init__(self, obj):
        self.obj = obj

    def __getattr__(self, name):
        return _Method(getattr(self.obj, name))


class InlineRay:
    """Executes each actor call when it is made: the order of calls per actor is what Ray guarantees."""

    def __init__(self, make):
        self.make = make  # (spec, threads) -> the actor object
        self.killed = 0

    def remote(self, cls):
        ray = self

        class Handle:
            @staticmethod
            def options(**_):
                return Handle

            @staticmethod
            def remote(*args):
                return _Actor(ray.make(*args))

        return Handle

    def put(self, value):
        return _Ref(value)

    def get(self, refs):
        return [r.value for r in refs] if isinstance(refs, list) else refs.value

    def wait(self, refs, num_returns=1, timeout=None):
        return list(refs)[:num_returns] if timeout is None else list(refs), []

    def kill(self, actor):
        self.killed += 1


@pytest.mark.parametrize("max_staleness", [0, 1, 2])
def test_ray_collector_trains_each_step_on_the_version_max_staleness_behind(model, tok, max_staleness):
    from posttrain.rl.ray_collector import GeneratorActor

    def make(spec, threads):
        actor = GeneratorActor.__new__(GeneratorActor)
        actor.worker, actor.applied = make_worker(model, tok, group_size=2, max_new_tokens=3), []
        return actor

    ray = InlineRay(make)
    feed = PromptFeed(Batches(prompt_dataset(tok), 2, prompt_collate, seed=0), seed=1)
    collector = RayCollector(ray, spec=None, feed=feed, num_generators=2, max_staleness=max_staleness)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    versions = []
    for version in range(6):
        rollouts, _ = collector.next(version)
        versions.append(rollouts.version)
        assert version - rollouts.version <= max_staleness
        collector.push_weights(state, version + 1)
    assert versions == [max(0, t - max_staleness) for t in range(6)]
    assert collector.buffer.dropped == []
    assert all(applied == list(range(1, 7)) for applied in collector.versions())
    collector.close()
    assert ray.killed == 2


def _inline_collector(model, tok, max_staleness, feed_state=None):
    """A RayCollector over two inline actors, each with its own copy of `model` (version 0)."""
    import copy

    from posttrain.rl.ray_collector import GeneratorActor

    def make(spec, threads):
        actor = GeneratorActor.__new__(GeneratorActor)
        actor.worker, actor.applied = make_worker(copy.deepcopy(model), tok, group_size=2, max_new_tokens=4), []
        return actor

    feed = PromptFeed(Batches(prompt_dataset(tok), 2, prompt_collate, seed=0), seed=1)
    if feed_state is not None:
        feed.load_state_dict(feed_state)
    return RayCollector(InlineRay(make), spec=None, feed=feed, num_generators=2, max_staleness=max_staleness), feed


def _checkpoint(collector, feed, ticket):
    """What the GRPO stage's resume state keeps of a collector after the step that trained `ticket`."""
    in_flight = collector.in_flight()
    return {"feed": feed.state_after(ticket), "in_flight": in_flight,
            "earlier": {v: {k: t.clone() for k, t in collector.weights_of(v).items()} for _, v in in_flight if v > 0}}


@pytest.mark.parametrize("max_staleness", [1, 2])
def test_a_resumed_ray_collector_samples_its_tickets_in_flight_again_with_their_own_versions(model, tok, max_staleness):
    """Checkpoint after step 2, resume, checkpoint again after step 3 (its in-flight work partly sampled by a
    version the resume loaded), resume again: every step gets the uninterrupted run's rollouts, token for token."""
    gen = torch.Generator().manual_seed(0)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    noise = [{k: torch.randn(v.shape, generator=gen) for k, v in start.items()} for _ in range(8)]
    states = [start] + [{k: v + 0.3 * n[k] for k, v in start.items()} for n in noise[1:]]  # policy version v's weights

    def step(collector, version):
        rollouts, _ = collector.next(version)
        collector.push_weights(states[version + 1], version + 1)
        return rollouts.ticket, rollouts.version, [(g.completions, g.logprobs) for g in rollouts.payload]

    collector, feed = _inline_collector(model, tok, max_staleness)
    whole = [step(collector, version) for version in range(6)]
    assert [v for _, v, _ in whole] == [max(0, t - max_staleness) for t in range(6)]
    assert len({str(c) for _, _, c in whole}) == 6  # the versions and prompts differ: so do the samples
    collector, feed = _inline_collector(model, tok, max_staleness)
    resumed = [step(collector, version) for version in range(2)]
    state = _checkpoint(collector, feed, ticket=2)
    assert [v for _, v in state["in_flight"]] == [max(0, t - 1 - max_staleness) for t in range(3, 3 + max_staleness)]
    for version, stop in ((2, 3), (3, 6)):  # resume after step 2, checkpoint after 3; resume after 3, run to 6
        collector, feed = _inline_collector(model, tok, max_staleness, state["feed"])
        collector.start_at(states[version], version, state["in_flight"], state["earlier"])
        resumed += [step(collector, v) for v in range(version, stop)]
        state = _checkpoint(collector, feed, ticket=stop)
    assert resumed == whole
    assert collector.buffer.dropped == []
    # the versions of the tickets in flight at step 3, then the trainer's (3), then pushed 4..6
    assert all(applied == list(range(3 - max_staleness, 7)) for applied in collector.versions())
    with pytest.raises(ValueError, match="no weights of policy version"):
        _inline_collector(model, tok, max_staleness, state["feed"])[0].start_at(states[6], 6, [(7, 5)], {})


def test_split_groups_and_ray_environment(monkeypatch):
    assert split_groups(list(range(6)), 1, 3) == [2, 3]
    with pytest.raises(ValueError, match="do not split"):
        split_groups(list(range(5)), 0, 2)
    for key in LOCAL_RAY_ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setitem(__import__("sys").modules, "ray", None)  # as if ray were not installed
    with pytest.raises(ImportError, match=r"posttrain\[ray\]"):
        import_ray()
    import os

    assert all(os.environ[k] == v for k, v in LOCAL_RAY_ENV.items())


def test_grpo_prompt_file_is_checked_and_read(tok, tmp_path):
    from posttrain.rl.prompts import training_prompts

    reward, data = str(tmp_path), str(tmp_path / "data")
    with pytest.raises(FileNotFoundError, match="grpo_prompts.parquet: missing"):
        training_prompts(data, reward, 2, seed=0, rank=0, world_size=1)
    frame = prompt_dataset(tok, 6).table.to_pandas().assign(pass_rate=0.5)  # as the reward stage writes it
    frame.drop(columns=["answer"]).to_parquet(tmp_path / "grpo_prompts.parquet")
    with pytest.raises(ValueError, match=r"missing column\(s\) answer"):
        training_prompts(data, reward, 2, seed=0, rank=0, world_size=1)
    frame.to_parquet(tmp_path / "grpo_prompts.parquet")
    with pytest.raises(ValueError, match="fewer than grpo.prompts_per_step"):
        training_prompts(data, reward, 8, seed=0, rank=0, world_size=1)
    batch = next(training_prompts(data, reward, 4, seed=0, rank=1, world_size=2))
    assert len(batch["prompt_ids"]) == 2 and batch["examples"][0]["task"] == "arithmetic"
