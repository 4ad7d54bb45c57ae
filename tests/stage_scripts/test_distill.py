"""The distillation stage: its chunked loss equals the full-logit computation, teacher/student
vocabularies are checked, on-policy runs resume exactly after a kill, 2-process runs match one, and a
student a quarter of the teacher's size learns the task from it better than from SFT alone."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from distill_testing import distill_config, random_model_folder, run_distill
from eval_fixtures import run_stage
from posttrain.model_files import load_hf_model
from posttrain.distill import VocabularyMismatchError, check_same_vocabulary, distill_loss, student_config
from posttrain.data.loader import eval_split_rows
from posttrain.evaluation.greedy import model_greedy_accuracy
from posttrain.losses.chunked import IGNORE_INDEX
from posttrain.losses.head import OutputHead
from posttrain.models import Transformer, document_positions, preset_config
from posttrain.tokenizer import Tokenizer, train_bpe_tokenizer
from posttrain.training.faults import KILL_AT_STEP_ENV
from posttrain.training.checkpointer import resume_dir
from sft_testing import metrics, prepare_data, resolved_config, run_sft, train_losses, weights
from test_losses_kd import naive_divergence, rel_err

VOCAB = 97


def _tiny(preset: str, seed: int, **shape) -> Transformer:
    torch.manual_seed(seed)
    return Transformer({**preset_config(preset, vocab_size=VOCAB), **shape})


def _packed_batch(seed: int) -> dict[str, torch.Tensor]:
    """Two rows of two packed documents each, prompt tokens and document ends untrained."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, VOCAB, (2, 24), generator=g)
    document_ids = torch.tensor([[0] * 10 + [1] * 14, [0] * 15 + [1] * 7 + [2] * 2])
    labels = torch.roll(input_ids, -1, dims=1)
    labels[:, :4] = IGNORE_INDEX
    labels[document_ids != torch.roll(document_ids, -1, dims=1)] = IGNORE_INDEX  # each document's last token
    labels[1, 15:19] = IGNORE_INDEX
    return {"input_ids": input_ids, "labels": labels, "document_ids": document_ids,
            "position_ids": document_positions(document_ids)}


def _full_logits_loss(student, teacher, batch, kind, beta, temperature, ce_weight) -> torch.Tensor:
    """The same objective from both models' whole [B, S, V] logits."""
    inputs = {"position_ids": batch["position_ids"], "document_ids": batch["document_ids"]}
    student_logits = student.lm_head(student(batch["input_ids"], **inputs))
    with torch.no_grad():
        teacher_logits = teacher.lm_head(teacher(batch["input_ids"], **inputs))
    kept = batch["labels"] != IGNORE_INDEX
    divergence = naive_divergence(student_logits, teacher_logits, kind, beta, temperature)[kept].sum()
    ce = F.cross_entropy(student_logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE_INDEX,
                         reduction="sum")
    return (1 - ce_weight) * divergence + ce_weight * ce


@pytest.mark.parametrize("kind,beta,temperature,ce_weight", [
    ("forward_kl", 0.5, 1.0, 0.5), ("reverse_kl", 0.5, 2.0, 0.0), ("jsd", 0.3, 0.7, 0.2),
])
@pytest.mark.parametrize("chunked", [True, False])
def test_stage_loss_equals_full_logits(kind, beta, temperature, ce_weight, chunked):
    student = _tiny("tiny-student", 0)
    teacher = _tiny("tiny", 1, hidden_size=64, intermediate_size=128, head_dim=16).requires_grad_(False).eval()
    batch = _packed_batch(2)
    distill = {"loss": kind, "jsd_beta": beta, "temperature": temperature}
    memory = {"chunked_ce": chunked, "ce_chunks": 5}

    got, parts = distill_loss(student, OutputHead(student, None, memory), teacher, OutputHead(teacher, None, memory), batch,
                              distill, ce_weight)
    got_grads = torch.autograd.grad(got, list(student.parameters()))
    ref = _full_logits_loss(student, teacher, batch, kind, beta, temperature, ce_weight)
    ref_grads = torch.autograd.grad(ref, list(student.parameters()))

    assert rel_err(got, ref) <= 1e-5
    for g, r in zip(got_grads, ref_grads):
        assert rel_err(g, r) <= 1e-5
    assert got.item() == pytest.approx(((1 - ce_weight) * parts["kd/divergence"] + ce_weight * parts["kd/ce"]).item())
    assert all(p.grad is None for p in teacher.parameters())


def _tokenizer(folder: Path, text: str, vocab_size: int = 300) -> Tokenizer:
    return train_bpe_tokenizer([text] * 20, vocab_size, folder)


def test_vocabulary_mismatch_stops_naming_both(tmp_path, monkeypatch, capsys):
    data_tok = _tokenizer(tmp_path / "data" / "tokenizer", "Compute 12 + 30. #### 42 Sort ascending: 3, 1, 2")
    other_tok = _tokenizer(tmp_path / "other-tok", "an entirely different corpus of words and letters")
    teacher = random_model_folder(tmp_path / "teacher", data_tok, preset="tiny-student")
    teacher_cfg = json.loads((teacher / "config.json").read_text())

    # Output heads of different widths (same tokenizer): both sides and both sizes are named.
    wide = random_model_folder(tmp_path / "wide-student", data_tok, preset="tiny-student", vocab_size=data_tok.vocab_size + 64)
    wide_cfg = json.loads((wide / "config.json").read_text())
    with pytest.raises(VocabularyMismatchError) as err:
        check_same_vocabulary(data_tok, teacher, teacher_cfg, str(wide), wide_cfg)
    message = str(err.value)
    assert str(teacher) in message and str(wide) in message
    assert str(teacher_cfg["vocab_size"]) in message and str(wide_cfg["vocab_size"]) in message

    # A student (or teacher) folder whose tokenizer is not the data's.
    foreign = random_model_folder(tmp_path / "foreign-student", other_tok, preset="tiny-student",
                                  vocab_size=teacher_cfg["vocab_size"])
    with pytest.raises(VocabularyMismatchError, match="student's tokenizer") as err:
        check_same_vocabulary(data_tok, teacher, teacher_cfg, str(foreign), teacher_cfg)
    assert str(foreign) in str(err.value) and str(data_tok.folder) in str(err.value)
    with pytest.raises(VocabularyMismatchError, match="teacher's tokenizer"):
        check_same_vocabulary(data_tok, foreign, teacher_cfg, "tiny-student", teacher_cfg)

    # Same tokenizer and width: accepted; a preset student takes the teacher's width.
    check_same_vocabulary(data_tok, teacher, teacher_cfg, "tiny-student", teacher_cfg)
    assert student_config("tiny-student", data_tok, wide_cfg)["vocab_size"] == wide_cfg["vocab_size"]

    # Through the command line: one line naming both sides, exit status 1, nothing written.
    cfg = distill_config("mismatch")
    cfg["model"]["student"] = str(wide)
    config = tmp_path / "mismatch.json"
    config.write_text(json.dumps(cfg))
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        run_stage("distill", ["--config", config, "--data", tmp_path / "data", "--teacher", teacher, "--out", out],
                  monkeypatch)
    assert exit_info.value.code == 1
    stderr = capsys.readouterr().err
    assert stderr.startswith("distill: error:") and str(teacher) in stderr and str(wide) in stderr
    assert not out.exists()


# --- stage runs on a small prepared data folder, with a random teacher ---

ON_POLICY = {"data": "on_policy", "on_policy_every": 2, "steps": 4, "checkpoint_every": 3}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return prepare_data(tmp_path_factory.mktemp("distill-data"))


@pytest.fixture(scope="module")
def teacher_dir(data_dir, tmp_path_factory) -> Path:
    return random_model_folder(tmp_path_factory.mktemp("teacher") / "teacher", Tokenizer(data_dir / "tokenizer"), seed=5)


@pytest.fixture(scope="module")
def on_policy_run(data_dir, teacher_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("on-policy") / "distill"
    run_distill(distill_config("on-policy", ON_POLICY), data_dir, teacher_dir, out)
    return out


@pytest.mark.slow
def test_on_policy_run_writes_student_metrics_and_summary(on_policy_run, teacher_dir):
    out = on_policy_run
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json", "metrics.jsonl"} <= {
        p.name for p in out.iterdir()
    }
    assert not resume_dir(out).exists()
    records = metrics(out)
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert {"divergence", "ce", "grad_norm", "lr", "tokens_per_s", "peak_memory_mb", "loss_tokens"} <= steps[0].keys()
    # The student samples every on_policy_every steps, for that many steps at once.
    assert [r["step"] for r in steps if "generated_tokens" in r] == [1, 3]
    record = json.loads((out / "posttrain.json").read_text())
    summary = record["metrics"]
    assert {"teacher_accuracy", "student_accuracy", "eval_divergence_before", "eval_divergence_after"} <= summary.keys()
    assert 0 <= summary["student_accuracy"] <= 1 and 0 <= summary["teacher_accuracy"] <= 1
    assert summary["teacher"] == str(teacher_dir)
    assert summary["student_params"] * 4 <= summary["teacher_params"]
    assert json.loads((out / "config.json").read_text())["vocab_size"] == json.loads(
        (teacher_dir / "config.json").read_text())["vocab_size"]


@pytest.mark.slow
def test_on_policy_resume_after_sigkill_matches_uninterrupted(on_policy_run, data_dir, teacher_dir, tmp_path):
    """Killed after the step-3 checkpoint, with step 4's completions sampled but not yet trained on."""
    out = tmp_path / "distill"
    cfg = distill_config("on-policy", ON_POLICY)
    killed = run_distill(cfg, data_dir, teacher_dir, out, check=False, **{KILL_AT_STEP_ENV: "3"})
    assert killed.returncode != 0 and not out.exists()
    assert (resume_dir(out) / "step-00000003").is_dir()
    run_distill(cfg, data_dir, teacher_dir, out)
    assert train_losses(metrics(out)) == train_losses(metrics(on_policy_run))
    resumed, uninterrupted = weights(out), weights(on_policy_run)
    assert all(torch.equal(resumed[k], uninterrupted[k]) for k in uninterrupted)


@pytest.mark.slow
def test_teacher_samples_train_on_the_teachers_completions_and_resume(on_policy_run, data_dir, teacher_dir, tmp_path):
    """distill.data: teacher_samples: the frozen teacher samples the prompts split; killed after the step-3
    checkpoint with step 4's completions pending, the rerun ends with the uninterrupted run's weights."""
    cfg = distill_config("teacher-samples", {**ON_POLICY, "data": "teacher_samples"})
    run_distill(cfg, data_dir, teacher_dir, tmp_path / "whole")
    steps = [r for r in metrics(tmp_path / "whole") if "loss" in r]
    assert [r["step"] for r in steps if "generated_tokens" in r] == [1, 3]
    # Same prompts and seeds as the on-policy run, other completions: the teacher's, not the student's.
    assert train_losses(metrics(tmp_path / "whole")) != train_losses(metrics(on_policy_run))
    out = tmp_path / "distill"
    killed = run_distill(cfg, data_dir, teacher_dir, out, check=False, **{KILL_AT_STEP_ENV: "3"})
    assert killed.returncode != 0 and (resume_dir(out) / "step-00000003").is_dir()
    run_distill(cfg, data_dir, teacher_dir, out)
    resumed, whole = weights(out), weights(tmp_path / "whole")
    assert all(torch.equal(resumed[k], whole[k]) for k in whole)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("name,distill,parallel", [
    ("tp", ON_POLICY, {"tp": 2}),  # vocabulary-sharded heads; sampling from the gathered student
    ("fsdp", {"steps": 3}, {}),  # FSDP2 shards of teacher and student
    ("cp", {"steps": 3}, {"cp": 2}),  # both models hold half of every row
])
def test_two_processes_match_one(name, distill, parallel, data_dir, teacher_dir, on_policy_run, tmp_path):
    if name == "tp":
        expected = train_losses(metrics(on_policy_run))
    else:
        run_distill(distill_config(name, distill), data_dir, teacher_dir, tmp_path / "one")
        expected = train_losses(metrics(tmp_path / "one"))
    out = tmp_path / "two"
    run_distill(distill_config(name, distill, parallel=parallel), data_dir, teacher_dir, out, nproc=2)
    assert train_losses(metrics(out)) == pytest.approx(expected, rel=1e-5)


# The learning tests on the default task: config.yaml's data section, a teacher trained by the default
# SFT section, the default distill section at 400 steps (`KD_STEPS`: half the default 800, which only
# seed 2's forward-KL student of the pipeline needed), and the same student trained by SFT alone with
# the distill section's steps, batch and schedule. Margins from `python benchmarks/quality/learning_spread.py kd`
# (seeds 1234, 1, 2 at one and at two threads; AMD EPYC with AVX-512, 2026-12-01; both thread counts
# gave the same measures):
# - on the 800 labelled rows: teacher 0.73-0.89, KD student / teacher 0.97-1.25, KD minus labels alone
#   -0.03 to +0.13: the labels alone teach this student, so KD is held to "not worse", not to beating it;
# - on 40 labelled rows plus 400 unlabelled prompts that the teacher answers (distill.data:
#   teacher_samples): KD student 0.60-0.82, labels alone 0.06-0.14 (gain 0.54-0.72), KD / teacher 0.82-0.92.
LEARN_DATA = resolved_config("prepare_data", "learn")["data"]
LEARN_SEED = resolved_config("prepare_data", "learn")["seed"]
NO_CHECKPOINTS = {"checkpoint_every": 1000}
KD_STEPS = {"steps": 400}  # the steps the margins below were measured at
SCARCE_DATA = {"n_sft": 40, "n_preference": 8, "n_prompts": 400}  # few labels, many unlabelled prompts
MIN_TEACHER_ACCURACY = 0.5
MAX_KD_SHORTFALL = 0.06
MIN_KD_GAIN = 0.3
SHARED = ("steps", "batch_size", "grad_accum", "lr", "min_lr_ratio", "warmup_steps", "max_grad_norm")


def learn_config(stage: str, key: str, **sections: dict) -> dict:
    return resolved_config(stage, key, data=LEARN_DATA, **sections)


def learning_teacher(tmp: Path, seed: int = LEARN_SEED, threads: int = 1) -> tuple[Path, Path]:
    """(data, teacher): the default data and a teacher trained by the default SFT section."""
    data = prepare_data(tmp, LEARN_DATA, seed=seed)
    teacher = tmp / "teacher"
    run_sft({**learn_config("sft", "teacher", sft=NO_CHECKPOINTS), "seed": seed}, data, teacher,
            OMP_NUM_THREADS=str(threads))
    return data, teacher


def kd_against_labels(tmp: Path, data: Path, teacher: Path, seed: int, threads: int,
                      distill: dict | None = None) -> dict[str, float]:
    """Eval accuracies of the teacher, a KD student (default distill section plus `distill`) and the same
    student trained by SFT alone on `data`'s labelled split with the same steps, batch and schedule.

    With one thread the two students train side by side (one core each); with more, one after the other.
    """
    tmp.mkdir(parents=True, exist_ok=True)
    kd_cfg = {**learn_config("distill", "kd", distill={**NO_CHECKPOINTS, **KD_STEPS, **(distill or {})}), "seed": seed}
    sft_cfg = learn_config("sft", "sft-student", sft={**{k: kd_cfg["distill"][k] for k in SHARED}, **NO_CHECKPOINTS})
    sft_cfg["model"]["policy"] = kd_cfg["model"]["student"]
    sft_cfg["seed"] = seed
    with ThreadPoolExecutor(2 if threads == 1 else 1) as pool:
        kd_run = pool.submit(run_distill, kd_cfg, data, teacher, tmp / "kd", OMP_NUM_THREADS=str(threads))
        sft_run = pool.submit(run_sft, sft_cfg, data, tmp / "sft-student", OMP_NUM_THREADS=str(threads))
        kd_run.result(), sft_run.result()
    summary = json.loads((tmp / "kd" / "posttrain.json").read_text())["metrics"]
    tok = Tokenizer(data / "tokenizer")
    held_out = eval_split_rows(data, kd_cfg["distill"]["eval_prompts"])
    prompts, examples = held_out["prompt_ids"], held_out["examples"]
    labels_only = model_greedy_accuracy(load_hf_model(tmp / "sft-student"), prompts, examples, tok, "task",
                                        kd_cfg["distill"]["max_new_tokens"], None, torch.device("cpu"))
    return {"teacher": summary["teacher_accuracy"], "kd": summary["student_accuracy"], "labels_only": labels_only,
            "size_ratio": summary["teacher_params"] / summary["student_params"]}


def kd_on_unlabelled_prompts(tmp: Path, data: Path, teacher: Path, seed: int, threads: int) -> dict[str, float]:
    """The teacher's samples for SCARCE_DATA's unlabelled prompts (distill.data: teacher_samples) against
    labels alone on its few labelled rows: the data, with the teacher's tokenizer, prepared under `tmp`."""
    tmp.mkdir(parents=True, exist_ok=True)
    scarce = prepare_data(tmp, {**LEARN_DATA, **SCARCE_DATA}, seed=seed, model={"tokenizer": str(data / "tokenizer")},
                          name="scarce")
    return kd_against_labels(tmp / "scarce-runs", scarce, teacher, seed, threads, {"data": "teacher_samples"})


@pytest.fixture(scope="module")
def learned(tmp_path_factory) -> tuple[Path, Path]:
    return learning_teacher(tmp_path_factory.mktemp("kd-learn"))


@pytest.mark.slow
@pytest.mark.timeout(2400)  # three trainings: ~4 min on 2 idle cores
def test_kd_student_reaches_its_teacher(learned, tmp_path):
    data, teacher = learned
    result = kd_against_labels(tmp_path, data, teacher, LEARN_SEED, threads=1)
    print(result)
    assert result["size_ratio"] >= 4
    assert result["teacher"] >= MIN_TEACHER_ACCURACY  # a teacher worth distilling
    assert result["kd"] >= 0.9 * result["teacher"]
    assert result["kd"] >= result["labels_only"] - MAX_KD_SHORTFALL


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_kd_on_unlabelled_prompts_beats_labels_alone(learned, tmp_path):
    data, teacher = learned
    result = kd_on_unlabelled_prompts(tmp_path, data, teacher, LEARN_SEED, threads=1)
    print(result)
    assert result["kd"] >= result["labels_only"] + MIN_KD_GAIN
    assert result["kd"] >= 0.75 * result["teacher"]
