"""Multi-turn environments: episodes are token-in/token-out (the model's tokens as sampled, the environment's turns
as transformers' `apply_chat_template` renders them, the loss mask on the model's tokens only), tool calls parse
in the template's convention, the built-in tools answer, and a tool's failure is an observation while the run goes
on (the sandbox's escapes: tests/rl/test_sandbox.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from posttrain.envs import BUILTIN_ENVIRONMENTS, load_environment
from posttrain.envs.episodes import run_episodes
from posttrain.envs.builtin import Calculator, GuessNumber, Python, calculate
from posttrain.envs.sandbox import Limits, run_python
from posttrain.envs.tool_calls import format_call, parse_assistant
from posttrain.generation import GenerationOutput
from posttrain.generation.sampler import SamplingParams
from posttrain.tokenizer import CHATML_TOOLS_TEMPLATE, Tokenizer, set_chat_template, train_bpe_tokenizer

QUESTIONS = {"What is 12*7?": "12*7", "What is 93-48?": "93-48"}


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    folder = tmp_path_factory.mktemp("tools-tokenizer")
    texts = [f"{q} {format_call('calculate', {'expression': e})} #### 84 higher lower" for q, e in QUESTIONS.items()]
    train_bpe_tokenizer(texts * 20, 400, folder)
    set_chat_template(folder, CHATML_TOOLS_TEMPLATE)
    return Tokenizer(folder)


class Scripted:
    """A backend that answers each episode's turns from a script: its turn texts, each ended by <|im_end|>, with
    made-up log-probs; it finds the episode by the question in the prompt and the turn by the turns before."""

    version = 0

    def __init__(self, tok: Tokenizer, scripts: dict[str, list[str]]):
        self.tok, self.scripts = tok, scripts
        self.sampled: dict[str, list[list[int]]] = {q: [] for q in scripts}

    def generate(self, prompts, params, seed):
        tokens = []
        for prompt in prompts:
            text = self.tok.decode(prompt, skip_special_tokens=False)
            question = next(q for q in self.scripts if q in text)
            turn = text.count("<|im_start|>assistant") - 1
            ids = self.tok.encode(self.scripts[question][turn]) + [self.tok.eos_id]
            self.sampled[question].append(ids)
            tokens.append(ids)
        return GenerationOutput(tokens, [[-0.25 - 0.01 * k for k in range(len(t))] for t in tokens], ["stop"] * len(tokens))


def _hf(tok: Tokenizer):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(tok.folder)


def test_trajectories_are_the_templates_rendering_and_the_mask_is_the_models_tokens(tok):
    scripts = {q: [format_call("calculate", {"expression": e}), f"#### {calculate(e)}"] for q, e in QUESTIONS.items()}
    backend = Scripted(tok, scripts)
    envs = [Calculator({"prompt": q, "answer": calculate(e)}) for q, e in QUESTIONS.items()]
    params = SamplingParams(max_new_tokens=64, stop_token_ids=tok.eos_ids)
    trajectories = run_episodes(backend, tok, params, envs, seed=0, max_turns=4, max_tokens=400)
    hf = _hf(tok)
    for (question, expression), traj in zip(QUESTIONS.items(), trajectories):
        assert traj.finish_reason == "stop" and traj.turns == 2 and traj.tool_calls == 1 and traj.invalid_tool_calls == 0
        assert traj.messages[2] == {"role": "tool", "name": "calculate", "content": calculate(expression)}
        assert traj.final_text == f"#### {calculate(expression)}"
        # the whole trajectory decodes to transformers' rendering of its conversation (the template's newline after
        # the last <|im_end|> was never sampled)
        rendered = hf.apply_chat_template(traj.messages, tools=envs[0].tools(), tokenize=False)
        assert tok.decode(traj.prompt_ids + traj.tokens, skip_special_tokens=False) + "\n" == rendered
        prompt = hf.apply_chat_template(traj.messages[:1], tools=envs[0].tools(), tokenize=True, add_generation_prompt=True)
        assert traj.prompt_ids == list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
        # the mask covers exactly the sampled tokens, in order, with the sampler's log-probs
        sampled = [t for t, m in zip(traj.tokens, traj.mask) if m]
        assert sampled == [t for turn in backend.sampled[question] for t in turn]
        assert [lp for lp, m in zip(traj.logprobs, traj.mask) if m] == [
            -0.25 - 0.01 * k for turn in backend.sampled[question] for k in range(len(turn))]
        assert all(lp == 0.0 for lp, m in zip(traj.logprobs, traj.mask) if not m) and not all(traj.mask)
        assert len(traj.tokens) == len(traj.mask) == len(traj.logprobs)


def test_guess_the_number_needs_the_environments_replies(tok):
    env = GuessNumber({"id": "row-3", "prompt": "unused"}, high=16)
    guesses, low, high = [], 1, 16
    while True:  # binary search, as a model that reads the replies would
        guess = (low + high) // 2
        guesses.append(guess)
        if guess == env.secret:
            break
        low, high = (guess + 1, high) if guess < env.secret else (low, guess - 1)
    question = env.messages()[0]["content"]
    backend = Scripted(tok, {question: [str(g) for g in guesses]})
    traj, = run_episodes(backend, tok, SamplingParams(max_new_tokens=8, stop_token_ids=tok.eos_ids), [env], seed=0,
                         max_turns=8, max_tokens=400)
    assert traj.env_reward == 1.0 and traj.turns == len(guesses) and traj.finish_reason == "stop"
    replies = [m["content"] for m in traj.messages if m["role"] == "user"][1:]
    assert replies == ["higher" if g < env.secret else "lower" for g in guesses[:-1]]
    # the same game with a turn cap below what it takes: no reward, ended by the cap
    short = GuessNumber({"id": "row-3", "prompt": "unused"}, high=16)
    capped, = run_episodes(Scripted(tok, {question: [str(g) for g in guesses]}), tok,
                           SamplingParams(max_new_tokens=8, stop_token_ids=tok.eos_ids), [short], seed=0,
                           max_turns=1, max_tokens=400)
    assert len(guesses) == 1 or (capped.env_reward == 0.0 and capped.finish_reason == "turns" and capped.turns == 1)


def test_tool_calls_parse_in_the_templates_convention():
    message, invalid = parse_assistant('Let me compute.\n<tool_call>\n{"name": "calculate", "arguments": {"expression": "2+2"}}'
                                       '\n</tool_call>\n<tool_call>{"name": 3}</tool_call><tool_call>{"name": "x", ')
    assert message == {"role": "assistant", "content": "Let me compute.",
                       "tool_calls": [{"type": "function", "function": {"name": "calculate", "arguments": {"expression": "2+2"}}}]}
    assert invalid == 2  # a name that is not a string, and a block never closed
    assert parse_assistant("#### 4") == ({"role": "assistant", "content": "#### 4"}, 0)


def test_tool_errors_are_observations():
    env = Calculator({"prompt": "p"})
    reply = env.step({"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "calculate", "arguments": {"expression": "1/0"}}},
        {"function": {"name": "search", "arguments": {}}},
        {"function": {"name": "calculate", "arguments": {"expr": "1"}}},
        {"function": {"name": "calculate", "arguments": '{"expression": "6*7"}'}}]})
    assert [m["content"] for m in reply.messages] == ["error: division by zero", "error: no tool 'search'; tools: calculate",
                                                      "error: calculate takes expression", "42"]
    assert not reply.done and env.step({"role": "assistant", "content": "#### 42"}).done
    assert calculate("9**9**9").startswith("error: Pow is not supported")


def test_sandbox_runs_code_in_its_own_folder_and_the_episode_goes_on():
    assert run_python("open('a.txt', 'w').write('hi'); print(open('a.txt').read(), 6 * 7)") == "hi 42"
    assert run_python("print('x' * 50)", Limits(output_chars=10)).startswith("xxxxxxxxxx\n... (output cut")
    env = Python({"prompt": "p"}, timeout_s=2)
    reply = env.step({"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "run_python", "arguments": {"code": "while True: pass"}}},
        {"function": {"name": "run_python", "arguments": {"code": "print(2 ** 10)"}}}]})
    assert [m["content"] for m in reply.messages] == ["error: the code ran past its 2 s limit and was stopped", "1024"]


def test_user_environments_load_from_a_file(tmp_path):
    (tmp_path / "myenv.py").write_text(
        "from posttrain.envs import Environment, Reply\n"
        "class Echo(Environment):\n"
        "    def step(self, message):\n"
        "        return Reply(reward=float(message['content'] == self.example['answer']), done=True)\n"
        "def not_an_env():\n    pass\n")
    cls = load_environment("myenv.py:Echo", tmp_path)
    assert cls({"prompt": "p", "answer": "4"}).step({"role": "assistant", "content": "4"}).reward == 1.0
    with pytest.raises(TypeError, match="is not a subclass of posttrain.envs.Environment"):
        load_environment("myenv.py:not_an_env", tmp_path)
    with pytest.raises(ImportError, match="environment 'nope.py:X': no such file"):
        load_environment("nope.py:X", tmp_path)
    assert set(BUILTIN_ENVIRONMENTS) == {"calculator", "python", "guess_number"}


def test_micro_batches_train_only_the_models_tokens():
    import torch

    from posttrain.losses.chunked import IGNORE_INDEX
    from posttrain.rl.batch import micro_batches
    from posttrain.rl.rollout import RolloutGroup

    group = RolloutGroup(prompt_ids=[1, 2], example={}, completions=[[5, 6, 7, 8, 9]],
                         logprobs=[[-0.1, -0.2, 0.0, 0.0, -0.3]], finish_reasons=["stop"], rewards=[1.0],
                         correct=[True], version=0, masks=[[True, True, False, False, True]])
    batch, = micro_batches([group], torch.tensor([1.0]), size=1, pad_id=0)
    # position t predicts token t + 1: the environment's tokens 7 and 8 are context, never targets
    assert batch.targets[0].tolist() == [IGNORE_INDEX, 5, 6, IGNORE_INDEX, IGNORE_INDEX, 9, IGNORE_INDEX]
    assert batch.input_ids[0].tolist() == [1, 2, 5, 6, 7, 8, 9]
    assert batch.mask[0].sum() == 3


@pytest.fixture(scope="module")
def game_policy(tmp_path_factory) -> tuple[Path, Path]:
    """(data folder, model folder): a policy that answers with a number and ends its turn (grpo_testing's
    `turn_ending_policy`), so guess-the-number episodes run several turns."""
    from grpo_testing import turn_ending_policy

    return turn_ending_policy(tmp_path_factory.mktemp("game-policy"))


@pytest.mark.slow
def test_grpo_runs_multi_turn_episodes_and_trains_on_the_models_tokens(game_policy, tmp_path):
    """GRPO with guess-the-number from a briefly fine-tuned policy (it answers with numbers and ends its turns;
    `format` beside the game's reward gives the groups a signal):
    episodes take several turns (the environment answers until the number is found), the metrics say so, and
    the run trains and writes its output."""
    from grpo_testing import GAME_DATA, GUESS_NUMBER, grpo_config, run_grpo, step_records
    from sft_testing import weights
    from torch import equal as torch_equal

    data, policy = game_policy
    cfg = grpo_config("env", data=GAME_DATA, reward={"verifiers": ["environment", "format"]}, steps=2,
                      prompts_per_step=4, group_size=4, max_new_tokens=8, eval_prompts=4, checkpoint_every=100,
                      log_every=1, lr=1e-3, environment=GUESS_NUMBER)
    out = tmp_path / "grpo"
    run_grpo(cfg, data, policy, out)
    records = step_records(out)
    assert len(records) == 2
    assert all(r["turns_mean"] > 1.5 for r in records), [r["turns_mean"] for r in records]
    assert all(r["tool_calls_mean"] == 0 for r in records)  # the game offers no tools
    trained, start = weights(out), weights(policy)
    assert any(not torch_equal(trained[k], start[k]) for k in start)  # the policy's own tokens were trained on


def test_the_plan_and_the_dry_run_with_an_environment(tmp_path, monkeypatch):
    from posttrain.workflow.plan import build_plan
    from posttrain.workflow.schema import ConfigError, load_config, merge, validate_config

    base = merge(load_config(), {"ablations": None, "pipeline": ["sft", "grpo"]})
    with_env = validate_config(merge(base, {"environment": {"fn": "calculator"}}))
    stages = next(iter(build_plan(with_env).variants.values())).stages
    assert stages["grpo"].inputs["reward"] is stages["reward"]  # the band of the episodes GRPO runs
    assert stages["reward"].resolved["environment"]["fn"] == "calculator"  # its key covers the environment
    monkeypatch.chdir(tmp_path)
    (tmp_path / "env.py").write_text("class NotAnEnvironment:\n    pass\n")
    with pytest.raises(ConfigError, match=r"environment.fn: environment 'env.py:NotAnEnvironment': .* is not a subclass"):
        validate_config(merge(base, {"environment": {"fn": "env.py:NotAnEnvironment"}}))
    with pytest.raises(ConfigError, match=r"environment.fn: environment 'calculater': not a built-in"):
        validate_config(merge(base, {"environment": {"fn": "calculater"}}))


@pytest.mark.slow
def test_the_reward_stage_scores_the_episodes_grpo_runs(game_policy, tmp_path, monkeypatch):
    """With an environment the reward stage samples and scores what GRPO would: its episodes are, token for token
    and reward for reward, those GRPO's rollout worker collects for the same prompts and seed; its pass rates count
    them, and its on-policy pairs are whole conversations (the game's replies included) that DPO's reader takes."""
    import pandas as pd
    from eval_fixtures import run_stage, write_config
    from grpo_testing import GAME_DATA, GUESS_NUMBER
    from sft_testing import resolved_config

    from posttrain.data.sources import canonical_rows, load_source
    from posttrain.data.store import load_split
    from posttrain.rl.rollout import EpisodeSettings, PromptBatch, WorkerSpec, build_worker

    data, policy = game_policy
    reward = {"verifiers": ["environment", "format"], "n_prompts": 6, "samples_per_prompt": 4, "max_new_tokens": 8}
    cfg = resolved_config("reward", "env-reward", data=GAME_DATA, reward=reward, environment=GUESS_NUMBER)
    out = tmp_path / "reward"
    run_stage("reward", ["--config", write_config(tmp_path / "reward.json", cfg), "--data", data, "--model", policy,
                         "--out", out], monkeypatch)
    rollouts = pd.read_parquet(out / "rollouts.parquet")

    rows = load_split(data, "prompts").select(range(6)).to_list()
    worker = build_worker(WorkerSpec(
        backend="native", model_dir=str(policy), model_backend=cfg["model"]["backend"], tokenizer_dir=str(data / "tokenizer"),
        group_size=4, temperature=cfg["reward"]["temperature"], max_new_tokens=8, verifiers=("environment", "format"),
        seed=cfg["seed"], episodes=EpisodeSettings.from_config(GUESS_NUMBER, None)))
    groups = worker.collect(PromptBatch([r["prompt_ids"] for r in rows], [json.loads(r["example"]) for r in rows],
                                        list(range(6))), seed=cfg["seed"])  # the stage's one call: seed + 0
    assert [list(ids) for ids in rollouts["completion_ids"]] == [c for g in groups for c in g.completions]
    assert rollouts["reward"].tolist() == [r for g in groups for r in g.rewards]
    assert [list(m) for m in rollouts["mask"]] == [m for g in groups for m in g.masks]
    assert rollouts["prompt"].str.contains("I am thinking of a number from 1 to 4").all()
    assert rollouts["reward/environment"].max() == 1.0  # some games were won ...
    assert any(not all(m) for m in rollouts["mask"])  # ... and some took turns: environment tokens in the episode
    stats = json.loads((out / "stats.json").read_text())
    assert stats["turns_mean"] > 1 and stats["turns_mean"] == pytest.approx(
        sum(e["turns"] for g in groups for e in g.episodes) / 24)

    pairs = [json.loads(line) for line in (out / "pairs.jsonl").read_text().splitlines()]
    assert pairs and len(pairs) == stats["pairs"]
    for pair in pairs:
        said = rollouts[rollouts["prompt_index"] == pair["prompt_index"]]
        assert pair["chosen_reward"] == said["reward"].max() and pair["rejected_reward"] == said["reward"].min()
        assert "I am thinking of a number" in pair["prompt"][-1]["content"]
        assert pair["chosen"][0]["role"] == "assistant"
    replies = [m["content"] for p in pairs for side in ("chosen", "rejected") for m in p[side] if m["role"] == "user"]
    assert set(replies) <= {"higher", "lower", "Answer with a number."} and replies  # the game's turns are in them
    as_source, _ = canonical_rows(load_source(str(out / "pairs.jsonl")), "preference", "pairs.jsonl")
    assert [r["chosen"] for r in as_source] == [p["chosen"] for p in pairs]


@pytest.mark.slow
def test_the_evaluate_stage_scores_episodes(game_policy, tmp_path, monkeypatch):
    """With an environment, evaluate's greedy and sampled completions are episodes: guess-the-number scored by the
    environment's reward, with turns and tool calls in its metrics, and each episode logged whole."""
    from eval_fixtures import run_stage, write_config
    from grpo_testing import GAME_DATA, GUESS_NUMBER
    from sft_testing import resolved_config

    data, model = game_policy
    cfg = resolved_config("evaluate", "env-eval", data=GAME_DATA, reward={"verifiers": ["environment"]},
                          eval={"n_prompts": 6, "samples": 2, "pass_k": [1, 2], "max_new_tokens": 8, "lm_eval_tasks": []},
                          environment=GUESS_NUMBER)
    out = tmp_path / "eval"
    run_stage("evaluate", ["--config", write_config(tmp_path / "eval.json", cfg), "--data", data, "--model", model,
                           "--out", out], monkeypatch)
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["n_prompts"] == 6 and 1 <= metrics["turns_mean"] <= 3 and metrics["tool_calls_mean"] == 0
    assert 0.0 <= metrics["accuracy"] <= 1.0 and "pass@2" in metrics
    # the log shows each episode as the model saw it: the game's opening, then every turn and every reply
    logged = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(logged) == 6 and sum(r["turns"] for r in logged) / 6 == pytest.approx(metrics["turns_mean"])
    assert max(r["turns"] for r in logged) > 1  # episodes with replies to show
    for record in [*logged, *(s for r in logged for s in r["samples"])]:
        assert "I am thinking of a number from 1 to 4" in (record.get("prompt") or logged[0]["prompt"])
        said = [m for m in record["messages"] if m["role"] == "assistant"]
        assert len(said) == record["turns"] and record["completion"] == said[-1]["content"]
        replies = [m["content"] for m in record["messages"][1:] if m["role"] == "user"]
        assert len(replies) >= record["turns"] - 1 and set(replies) <= {"higher", "lower", "Answer with a number."}
        for reply in replies:
            assert f"<|im_start|>user\n{reply}<|im_end|>" in record["episode"]


TOOL_DATA = {"tasks": [{"name": "arithmetic", "ops": ["add"], "digits": 1}], "n_sft": 0, "n_preference": 4,
             "n_prompts": 32, "n_eval": 8, "max_seq_len": 384, "vocab_size": 400}


def tool_demonstrations(path: Path) -> Path:
    """Demonstrations of both built-in tools on the task's problems: half `calculate(a + b)`, half
    `run_python("print(a + b)")`, each row offering its own tool, the result copied into `#### <answer>`."""
    from posttrain.data.tasks import make_splits

    rows = []
    for i, row in enumerate(make_splits(TOOL_DATA["tasks"], {"sft": 64}, seed=11)["sft"]):
        expression = row["prompt"].removeprefix("Compute ").removesuffix(".")
        env = (Calculator if i % 2 else Python)({"prompt": ""})
        name, arguments = ("calculate", {"expression": expression}) if i % 2 else \
            ("run_python", {"code": f"print({expression})"})
        result = calculate(expression)
        rows.append({"messages": [{"role": "user", "content": row["prompt"]},
                                  {"role": "assistant", "content": "", "tool_calls": [
                                      {"type": "function", "function": {"name": name, "arguments": arguments}}]},
                                  {"role": "tool", "name": name, "content": result},
                                  {"role": "assistant", "content": f"#### {result}"}],
                     "tools": env.tools()})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def tool_calling_policy(tmp_path_factory) -> tuple[Path, Path, dict]:
    """(data folder, model folder, data config): a small random model fine-tuned on `tool_demonstrations` until it
    writes tool calls, so GRPO's episodes call the tools."""
    from grpo_testing import random_policy
    from sft_testing import resolved_config, run_sft

    tmp = tmp_path_factory.mktemp("tool-calling")
    data_cfg = {**TOOL_DATA, "sources": [{"kind": "sft", "path": str(tool_demonstrations(tmp / "demos.jsonl"))}]}
    data, start = random_policy(tmp, data_cfg, {"chat_template": "chatml-tools"})
    cfg = resolved_config("sft", "tool-calling", data=data_cfg, model={"policy": str(start), "chat_template": "chatml-tools"},
                          sft={"steps": 200, "batch_size": 16, "lr": 3e-3, "warmup_steps": 5, "checkpoint_every": 1000})
    run_sft(cfg, data, tmp / "tool-calling")
    return data, tmp / "tool-calling", data_cfg


@pytest.mark.slow
@pytest.mark.parametrize("fn", ["python", "calculator"])
def test_grpo_runs_tool_episodes(fn, tool_calling_policy, tmp_path):
    """GRPO episodes with each built-in tool: the policy calls it, the tool's result comes back as a turn (the
    Python tool's from the sandbox), and the model answers on the next turn."""
    from grpo_testing import grpo_config, run_grpo, step_records

    data, policy, data_cfg = tool_calling_policy
    cfg = grpo_config(f"tools-{fn}", data=data_cfg, reward={"verifiers": ["task"]}, steps=2, prompts_per_step=4,
                      group_size=4, max_new_tokens=48, eval_prompts=4, checkpoint_every=100, log_every=1, lr=1e-4,
                      environment={"fn": fn, "max_turns": 2, "max_tokens": 120})
    cfg["model"]["chat_template"] = "chatml-tools"
    out = tmp_path / "grpo"
    run_grpo(cfg, data, policy, out)
    records = step_records(out)
    assert len(records) == 2
    assert all(r["tool_calls_mean"] > 0 and r["turns_mean"] > 1 for r in records), records
