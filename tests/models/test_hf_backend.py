"""The transformers backend (`model.backend`): families without a native port on transformers' own model code.

Tiny random GPT-NeoX, Starcoder2 and Granite (logits_scaling) models: our hidden states through our head
give transformers' logits, packed rows attend per document, greedy decoding matches `generate`, the SFT
stage trains them and writes folders transformers loads, and the dry run accepts them but not
`backend: native`. Bloom (no position_ids) covers packed rows by padding.
"""

from __future__ import annotations

import json

import pytest
import torch

from hf_testing import FAMILIES, VOCAB, hf_greedy, left_padded, save_family, transformers_weights
from posttrain.generation.sampler import SamplingParams, generate
from posttrain.model_files import CheckpointError, load_hf_model, model_tensors
from posttrain.models.args import ModelConfigError, model_backend
from posttrain.models.hf_backend import HFCausalLM
from posttrain.parallel import parallelize
from posttrain.workflow.preflight import model_source_problem

transformers = pytest.importorskip("transformers")

LOGITS_ATOL = 1e-5


@pytest.fixture(params=sorted(FAMILIES), scope="module")
def family(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf = save_family(request.param, folder)
    return request.param, hf, load_hf_model(folder, backend="auto").eval(), folder


def ids(batch: int, seq: int, seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def test_hidden_states_through_our_head_are_transformers_logits(family):
    name, hf, ours, _ = family
    assert isinstance(ours, HFCausalLM)
    tokens = ids(2, 17, seed=1)
    with torch.no_grad():
        diff = (ours.lm_head(ours(tokens)) - hf(tokens).logits).abs().max().item()
    print(f"\n{name}: logits max|diff| {diff:.2e}")
    assert diff <= LOGITS_ATOL


def test_names_are_the_checkpoints(family):
    _, hf, ours, _ = family
    assert set(ours.state_dict()) == set(hf.state_dict())


def test_packed_rows_match_each_document_alone(family):
    _, hf, ours, _ = family
    docs = [ids(1, 7, seed=3)[0], ids(1, 10, seed=4)[0]]
    doc_ids = torch.cat([torch.full((len(d),), i) for i, d in enumerate(docs)])[None]
    with torch.no_grad():
        packed = ours.lm_head(ours(torch.cat(docs)[None], document_ids=doc_ids))[0]
        alone = torch.cat([hf(d[None]).logits[0] for d in docs])
    assert ours.packing == "positions"
    assert (packed - alone).abs().max().item() <= LOGITS_ATOL


def test_a_model_without_position_ids_packs_by_padding(tmp_path):
    hf = save_family("bloom", tmp_path, n_embed=32, n_layer=2, n_head=4, hidden_dropout=0.0, attention_dropout=0.0)
    ours = load_hf_model(tmp_path, backend="transformers").eval()
    docs = [ids(1, 5, seed=5)[0], ids(1, 9, seed=6)[0], ids(1, 4, seed=7)[0]]
    rows = torch.stack([torch.cat(docs[:2]), torch.cat([docs[2], docs[1], docs[2][:1]])])
    doc_ids = torch.tensor([[0] * 5 + [1] * 9, [0] * 4 + [1] * 9 + [2]])
    with torch.no_grad():
        packed = ours.lm_head(ours(rows, document_ids=doc_ids))
        alone = [torch.cat([hf(d[None]).logits[0] for d in parts]) for parts in
                 ([docs[0], docs[1]], [docs[2], docs[1], docs[2][:1]])]
    assert ours.packing == "padding"
    assert (packed - torch.stack(alone)).abs().max().item() <= LOGITS_ATOL


def test_greedy_generation_matches_transformers(family):
    """Ragged prompts, left-padded, decoded through transformers' own KV cache."""
    _, hf, ours, _ = family
    prompts = [ids(1, 9, seed=8)[0].tolist(), ids(1, 5, seed=9)[0].tolist()]
    new = 6
    out = generate(ours, prompts, SamplingParams(max_new_tokens=new, temperature=0.0), pad_id=0)
    ref = hf_greedy(hf, prompts, new)
    assert out.tokens == ref
    padded, attention = left_padded(prompts)
    with torch.no_grad():
        first = torch.log_softmax(hf(padded, attention_mask=attention).logits[:, -1].float(), -1)
    expected = first.gather(-1, torch.tensor([[r[0]] for r in ref])).squeeze(-1)
    assert torch.allclose(torch.tensor([lp[0] for lp in out.logprobs]), expected, atol=1e-5)


def test_backend_choice_and_refusals(family):
    name, _, ours, folder = family
    config = json.loads((folder / "config.json").read_text())
    assert model_backend(config, "auto") == model_backend(config, "transformers") == "transformers"
    assert model_backend({"model_type": "llama"}, "auto") == "native"
    with pytest.raises(ModelConfigError, match="model.backend"):
        model_backend(config, "native")
    with pytest.raises(ModelConfigError, match="remote code"):
        model_backend({**config, "auto_map": {"AutoModelForCausalLM": "x.Y"}}, "auto")
    with pytest.raises(ModelConfigError, match="neither ported nor a causal LM"):
        model_backend({"model_type": "no_such_family"}, "auto")
    with pytest.raises(CheckpointError, match="unknown model_type"):  # the native loader, as before
        load_hf_model(folder)
    for key in ("tp", "cp", "ep"):
        with pytest.raises(ModelConfigError, match=f"parallel.{key}=2: the transformers backend"):
            parallelize(ours, None, {}, {key: 2})


def test_dry_run_accepts_the_folder_and_refuses_native(family):
    name, _, _, folder = family
    assert model_source_problem(str(folder)) is None
    assert model_source_problem(str(folder), backend="transformers") is None
    why = model_source_problem(str(folder), backend="native")
    assert f"model_type {name!r} has no native port" in why and "model.backend" in why


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_sft_trains_the_family_and_writes_a_folder_transformers_loads(name, tmp_path):
    """The SFT stage script from a saved folder, with activation checkpointing and the optimizer stepping in backward:
    the loss falls, the output is the family's own HF folder with the trained weights, and posttrain.json says which
    backend ran it."""
    from sft_testing import metrics, prepare_data, resolved_config, run_sft, train_losses, weights

    folder = tmp_path / "base"
    save_family(name, folder)
    data = prepare_data(tmp_path, {"n_sft": 120})
    sft = {"steps": 6, "batch_size": 8, "lr": 3e-3, "warmup_steps": 1, "checkpoint_every": 1000, "log_every": 1,
           "max_grad_norm": None}
    cfg = resolved_config("sft", f"hf-{name}", sft=sft, model={"policy": str(folder)},
                          memory={"activation_checkpointing": 1, "optimizer_in_backward": True})
    proc = run_sft(cfg, data, tmp_path / "out")
    assert "packed rows run as per-document position ids" in proc.stderr
    losses = train_losses(metrics(tmp_path / "out"))
    summary = json.loads((tmp_path / "out" / "posttrain.json").read_text())
    assert summary["metrics"]["model_backend"] == "transformers", summary
    assert summary["metrics"]["eval_loss_after"] < summary["metrics"]["eval_loss_before"], summary
    assert losses[-1] < losses[0], losses
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert type(loaded).__name__ == json.loads((folder / "config.json").read_text())["architectures"][0]
    loaded.save_pretrained(tmp_path / "resaved")  # under the checkpoint names, as the stage writes them
    written, resaved = weights(tmp_path / "out"), weights(tmp_path / "resaved")
    assert set(written) == set(resaved) and all(torch.equal(resaved[k], v) for k, v in written.items())
    before = weights(folder)
    assert any(not torch.equal(before[k], v) for k, v in written.items())


@pytest.mark.slow
@pytest.mark.distributed
def test_two_process_fsdp2_sft_on_it_matches_one_process(tmp_path):
    """FSDP2 over two processes (one `fully_shard` per decoder layer, gloo): the same global batch gives one process's
    losses and weights, and the gathered output is the family's own folder transformers loads."""
    from sft_testing import metrics, prepare_data, resolved_config, run_sft, train_losses, weights

    folder = tmp_path / "base"
    save_family("gpt_neox", folder)
    data = prepare_data(tmp_path, {"n_sft": 120})
    sft = {"steps": 4, "batch_size": 8, "lr": 3e-3, "warmup_steps": 1, "checkpoint_every": 1000, "log_every": 1}
    one_cfg = resolved_config("sft", "hf-one", sft=sft, model={"policy": str(folder)})
    two_cfg = resolved_config("sft", "hf-two", sft={**sft, "grad_accum": 2}, model={"policy": str(folder)})
    run_sft(one_cfg, data, tmp_path / "one")
    run_sft(two_cfg, data, tmp_path / "two", nproc=2)  # each rank reads half of every global batch
    one, two = train_losses(metrics(tmp_path / "one")), train_losses(metrics(tmp_path / "two"))
    assert len(one) == len(two) == 4 and one[-1] < one[0], (one, two)
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(two, one)), (one, two)
    summary = json.loads((tmp_path / "two" / "posttrain.json").read_text())
    assert summary["metrics"]["model_backend"] == "transformers"
    a, b = weights(tmp_path / "one"), weights(tmp_path / "two")
    # Adam normalizes each step (lr 3e-3 a step): the reduction's rounding moves weights by ~1e-5, not a bug's 1e-3
    assert set(a) == set(b) and max((a[k] - b[k]).abs().max().item() for k in a) < 1e-4
    loaded = transformers_weights(tmp_path / "two", tmp_path / "resaved")
    assert all(torch.equal(loaded[k], v) for k, v in b.items())


def gpt_neox_policy(tmp_path, family: str = "gpt_neox", **data_cfg):
    """(data folder, GPT-NeoX (or `family`) folder with the data's tokenizer): prepared task data (RANDOM_DATA, with
    `data_cfg`) and a random model sized to it."""
    from grpo_testing import RANDOM_DATA
    from sft_testing import prepare_data
    from posttrain.tokenizer import Tokenizer

    data = prepare_data(tmp_path, {**RANDOM_DATA, **data_cfg})
    tok = Tokenizer(data / "tokenizer")
    folder = tmp_path / "policy"
    save_family(family, folder, vocab_size=tok.vocab_size, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)
    tok.save(folder)
    return data, folder


@pytest.mark.slow
def test_grpo_trains_on_it_with_the_native_sampler_decoding_through_transformers(tmp_path):
    """Sync GRPO from a GPT-NeoX folder: the generator is the same transformers model (every weight push checked
    against the trainer's digests, on-policy log-probs equal to the trainer's), the KL reference is a frozen copy
    of it, and the output is the family's own folder with the trained weights."""
    from grpo_testing import RANDOM_DATA, grpo_config, run_grpo, step_records, summary
    from sft_testing import weights

    data, folder = gpt_neox_policy(tmp_path)
    cfg = grpo_config("hf", data=RANDOM_DATA, reward={"verifiers": ["tests/grpo_testing.py:length_reward"]}, steps=3,
                      prompts_per_step=4, group_size=4, max_new_tokens=8, eval_prompts=4, lr=3e-3, warmup_steps=0,
                      kl_coef=0.05, checkpoint_every=100, log_every=1)
    run_grpo(cfg, data, folder, tmp_path / "grpo")
    records, done = step_records(tmp_path / "grpo"), summary(tmp_path / "grpo")
    assert done["model_backend"] == "transformers" and done["policy_version"] == 3, done
    assert len(records) == 3 and all(r["staleness"] == 0 for r in records), records
    assert max(r["logprob_gap_mean"] for r in records) < 1e-4, [r["logprob_gap_mean"] for r in records]
    assert any(r["grad_norm"] > 0 for r in records)
    written, loaded = weights(tmp_path / "grpo"), transformers_weights(tmp_path / "grpo", tmp_path / "resaved")
    assert set(written) == set(loaded) and all(torch.equal(loaded[k], v) for k, v in written.items())
    assert "embed_out.weight" in written  # GPT-NeoX's checkpoint name of its head, as transformers saves it
    before = weights(folder)
    assert set(before) == set(written) and any(not torch.equal(before[k], v) for k, v in written.items())


def test_what_it_cannot_run_stops_before_any_work_naming_the_key(tmp_path, monkeypatch, capsys):
    """A value model (grpo.advantage: gae) and the int8 export copy are native only; a reward model needs a family
    transformers has a sequence classifier for (Granite has none)."""
    import subprocess
    import sys

    from eval_fixtures import run_stage, write_config
    from grpo_testing import RANDOM_DATA, grpo_config, run_grpo
    from sft_testing import ROOT, env_for, resolved_config
    from posttrain.utils.provenance import write_provenance

    data, folder = gpt_neox_policy(tmp_path)
    proc = run_grpo(grpo_config("gae", data=RANDOM_DATA, advantage="gae", steps=1), data, folder, tmp_path / "gae",
                    check=False)
    assert proc.returncode == 1 and "grpo.advantage: gae needs a critic" in proc.stderr, proc.stderr[-2000:]
    granite = tmp_path / "granite"
    save_family("granite", granite, vocab_size=json.loads((folder / "config.json").read_text())["vocab_size"])
    cfg = resolved_config("reward_model", "rm", reward_model={"source": "train"})
    rm = subprocess.run([sys.executable, str(ROOT / "stages" / "reward_model.py"), "--config",
                         str(write_config(tmp_path / "rm.json", cfg)), "--data", str(data), "--model", str(granite),
                         "--out", str(tmp_path / "rm")], capture_output=True, text=True, cwd=ROOT, env=env_for())
    assert rm.returncode == 1, rm.stderr[-2000:]
    assert rm.stderr.splitlines()[-1] == (
        "reward_model: error: reward_model.source: train: the policy's model_type 'granite' runs on the transformers "
        "backend (model.backend), and transformers has no sequence classifier (*ForSequenceClassification) for it to "
        "build the reward model on; name a pretrained reward model (a folder or hub id), or set it to null"), rm.stderr
    write_provenance(folder, {"key": "neox"}, "sft", 0.0, {})
    cfg = {"stage": "export", "key": "int8", "upstream": {"sft": "neox"}, "seed": 0, "model": {"backend": "auto"},
           "export": {"stage": "sft", "dtype": "float32", "int8": True, "push_to_hub": None, "dry_run": True}}
    with pytest.raises(SystemExit):
        run_stage("export", ["--config", write_config(tmp_path / "export.json", cfg), "--model", folder,
                             "--out", tmp_path / "export"], monkeypatch)
    assert "export.int8: the int8 copy quantizes the native model's layers" in capsys.readouterr().err
    assert not (tmp_path / "gae").exists() and not (tmp_path / "rm").exists() and not (tmp_path / "export").exists()


@pytest.mark.parametrize("method", ["full", "lora"])
def test_reward_model_stage_trains_its_sequence_classifier_which_transformers_scores_as_we_do(method, tmp_path):
    """The reward_model stage from a GPT-NeoX folder: transformers' GPTNeoXForSequenceClassification on the policy's
    decoder, trained (in full, or `all-linear` adapters with the score head in full), written as that class's folder,
    which transformers loads with every weight in place and scores as the stage's model does."""
    from lora_testing import assert_only_adapters_trained
    from sft_testing import metrics, resolved_config, run_stage_script, train_losses, weights
    from posttrain.rewards import HFRewardModel, load_reward_model, pad_right

    data, folder = gpt_neox_policy(tmp_path, n_preference=40)
    lora = {"rank": 4, "alpha": 8, "dropout": 0.0, "targets": "all-linear"}
    section = {"source": "train", "steps": 8, "batch_size": 8, "held_out": 0.2, "lr": 1e-2, "warmup_steps": 0,
               "eval_every": 8, "checkpoint_every": 1000, "log_every": 1, "method": method, "lora": lora}
    cfg = resolved_config("reward_model", f"rm-{method}", reward_model=section, model={"policy": str(folder)})
    out = run_stage_script("reward_model", cfg, data, tmp_path / "rm")
    losses = train_losses(metrics(out))
    assert len(losses) == 8 and losses[-1] < losses[0], losses
    summary = json.loads((out / "posttrain.json").read_text())["metrics"]
    assert summary["model_backend"] == "transformers", summary
    assert json.loads((out / "config.json").read_text())["architectures"] == ["GPTNeoXForSequenceClassification"]

    hf, info = transformers.AutoModelForSequenceClassification.from_pretrained(out, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    ours = load_reward_model(out, backend="auto").eval()
    assert isinstance(ours, HFRewardModel)
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(1, hf.config.vocab_size, (n,), generator=g).tolist() for n in (5, 12, 9)]
    tokens, lengths = pad_right(rows, pad_id=0)
    with torch.no_grad():
        theirs = hf.eval()(tokens, attention_mask=(tokens != 0).long()).logits.squeeze(-1)
        assert (ours(tokens, lengths) - theirs).abs().max().item() <= 1e-4

    torch.manual_seed(cfg["seed"])  # the stage's seed draws the new head
    start = load_reward_model(folder, backend="auto").state_dict()
    written = weights(out)
    assert set(written) == set(start) and not torch.equal(written["score.weight"], start["score.weight"])
    if method == "full":
        assert any(not torch.equal(written[k], v) for k, v in start.items() if k.startswith("gpt_neox.layers"))
    else:
        adapter = json.loads((out / "adapter" / "adapter_config.json").read_text())
        assert adapter["task_type"] == "SEQ_CLS" and adapter["modules_to_save"] == ["score"]
        # query_key_value, dense, dense_h_to_4h, dense_4h_to_h in each of the two layers; no adapter on the score head
        assert assert_only_adapters_trained(start, out, out / "adapter", lora["alpha"] / lora["rank"], head="score") == 8


def test_lora_sft_on_it_trains_only_adapters_that_load_with_peft(tmp_path):
    """`lora.targets: all-linear` on GPT-NeoX, whose projections have no Llama names: the SFT stage trains adapters on
    every linear layer but the head, the merged output is the start plus the adapters folded in (bitwise), and PEFT
    puts the saved adapter on transformers' own base model to give the merged output's logits."""
    from lora_testing import assert_only_adapters_trained
    from sft_testing import metrics, prepare_data, resolved_config, run_sft, train_losses

    peft = pytest.importorskip("peft")
    folder = tmp_path / "base"
    save_family("gpt_neox", folder)
    data = prepare_data(tmp_path, {"n_sft": 120})
    lora = {"rank": 4, "alpha": 8, "dropout": 0.0, "targets": "all-linear"}
    sft = {"steps": 8, "batch_size": 8, "lr": 2e-2, "warmup_steps": 0, "checkpoint_every": 1000, "log_every": 1,
           "method": "lora", "lora": lora}
    cfg = resolved_config("sft", "hf-lora", sft=sft, model={"policy": str(folder)})
    run_sft(cfg, data, tmp_path / "out")
    out = tmp_path / "out"
    losses = train_losses(metrics(out))
    assert sum(losses[-2:]) / 2 < losses[0] - 0.05, losses
    assert json.loads((out / "posttrain.json").read_text())["metrics"]["model_backend"] == "transformers"
    adapted = assert_only_adapters_trained(model_tensors(folder), out, out / "adapter", lora["alpha"] / lora["rank"])
    assert adapted == 2 * 4  # query_key_value, dense, dense_h_to_4h, dense_4h_to_h in each of the two layers
    assert json.loads((out / "adapter" / "adapter_config.json").read_text())["target_modules"] == sorted(
        ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"])

    base = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with_adapter = peft.PeftModel.from_pretrained(base, out / "adapter").eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokens = ids(3, 12, seed=2)
    with torch.no_grad():
        a, b = with_adapter(input_ids=tokens).logits, merged(input_ids=tokens).logits
        with with_adapter.disable_adapter():
            untrained = with_adapter(input_ids=tokens).logits
    assert (a - b).abs().max() <= 1e-5 * b.abs().max()
    assert (b - untrained).abs().max() > 1e-2


def test_qlora_dpo_on_it_scores_against_the_adapters_off_and_saves_an_adapter_later_stages_load(tmp_path):
    """QLoRA DPO on GPT-NeoX (NF4 base): the reference is the policy with its adapters off, so the first step's
    sigmoid loss is log 2 plus the chosen-NLL term, and training moves it; `save: adapter` writes the PEFT adapter
    alone, and the transformers backend starts from that folder as its base with the adapter folded in."""
    from sft_testing import metrics, prepare_data, resolved_config, run_stage_script

    folder = tmp_path / "base"  # NF4 splits a weight into blocks of 64 x 256 values: every weight a multiple of that
    save_family("gpt_neox", folder, hidden_size=128, intermediate_size=512, num_attention_heads=4)
    data = prepare_data(tmp_path, {"n_preference": 40})
    dpo = {"steps": 6, "batch_size": 4, "lr": 2e-2, "warmup_steps": 0, "checkpoint_every": 1000, "log_every": 1,
           "method": "qlora", "save": "adapter",
           "lora": {"rank": 4, "alpha": 8, "dropout": 0.0, "targets": ["query_key_value", "dense_4h_to_h"]}}
    cfg = resolved_config("dpo", "hf-qlora", dpo=dpo, model={"policy": str(folder)})
    out = run_stage_script("dpo", cfg, data, tmp_path / "dpo")
    steps = [r for r in metrics(out) if "loss" in r]
    weight = cfg["dpo"]["chosen_nll_weight"]
    assert steps[0]["loss"] == pytest.approx(0.6931 + weight * steps[0]["nll/chosen"], abs=1e-3)
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.05, [r["loss"] for r in steps]
    assert "model.safetensors" not in {p.name for p in out.iterdir()} and (out / "adapter_model.safetensors").exists()

    started = load_hf_model(out, backend="auto")  # a later stage's start: the base with the adapter folded in
    assert isinstance(started, HFCausalLM)
    folded, base = started.checkpoint_state(started.state_dict()), model_tensors(folder)
    expected = model_tensors(out)  # the native reader's merge of the same files
    assert folded.keys() == expected.keys() and all(torch.equal(folded[k], expected[k]) for k in expected)
    changed = {k for k in base if not torch.equal(base[k], folded[k])}
    assert changed and all(k.endswith(("query_key_value.weight", "dense_4h_to_h.weight")) for k in changed), changed
