"""Report: summary.tsv has one row per variant and evaluated stage in pipeline order; effects.tsv
groups seed replicates and takes each stage's change from the stage its model started from; the
objective curves follow the keys the stage scripts log; machine.json and the README table name
what made the numbers. Stage outputs are hand-written at a real plan's paths (tests/report_testing.py)."""

import json
import statistics
import time
from pathlib import Path

import matplotlib.image
import pandas as pd
import pytest
import torch
from eval_fixtures import REPO, run_stage
from report_testing import BETA_GROUP, TABLE, accuracy, write_outputs

from posttrain.report import readme_table
from posttrain.report.curves import objective_curves
from posttrain.report.effects import COLUMNS, effects_table
from posttrain.report.machine import ISA_FLAGS, cpu_model_and_flags
from posttrain.report.inputs import stage_runs
from posttrain.report.stage_times import stage_time_table
from posttrain.report.summary import HEAD_COLUMNS, TAIL_COLUMNS, group_name, read_summary
from posttrain.utils.provenance import write_provenance
from posttrain.workflow.schema import load_config
from posttrain.workflow.plan import MODEL_STAGES, build_plan

TSV = 1e-5  # the report writes 6 significant digits
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
FIGURES = ("objective_curves.png", "eval_metrics.png", "stage_effects.png")


def make_plan(root):
    table = root / "ablations.tsv"
    table.write_text(TABLE)
    return build_plan(load_config(REPO / "config" / "config.yaml",
                                  overrides={"results": str(root / "results"), "ablations": str(table)}))


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    plan = make_plan(tmp_path_factory.mktemp("report"))
    write_outputs(plan)
    return plan


@pytest.fixture(scope="module")
def out(plan):
    out = Path(plan.results) / "report"
    with pytest.MonkeyPatch.context() as mp:
        run_stage("report", ["--config", plan.report_config_path, "--out", out], mp)
    return out


def test_summary_rows_columns_and_values(out, plan):
    table = read_summary(out / "summary.tsv")
    assert list(table.columns) == [*HEAD_COLUMNS, "pass@1", "pass@2", *TAIL_COLUMNS]
    assert len(table) == 4 * len(MODEL_STAGES)
    row = table[(table.variant == "beta") & (table.stage == "distill")].iloc[0]
    beta = plan.variants["beta"]
    assert (row.key, row.eval_key) == (beta.stages["distill"].key, beta.evals["distill"].key)
    assert row.group == BETA_GROUP and row.seed == 1 and row.previous == "dpo"  # distilled from DPO
    assert row.accuracy == pytest.approx(accuracy("distill", 1, 0.2)) and row["pass@2"] == pytest.approx(0.61)
    assert row.train_steps == 10 and row.final_loss == pytest.approx(0.1) and row.train_wall_time_s >= 5.0
    assert row.overrides == f"{BETA_GROUP};seed=1"  # the report config on disk has sorted keys
    assert table[table.stage == "sft"].previous.isna().all()
    assert table[table.stage != "dpo"].pref_acc.isna().all()
    assert table[table.variant.isin(["seed1", "beta"]) & (table.stage == "sft")].key.nunique() == 1  # shared SFT


def test_stages_follow_the_pipeline_not_the_alphabet(out):
    assert list(json.loads(next(out.parent.glob("report.*.config.json")).read_text())["variants"]["seed1"]["eval"]) == \
        sorted(MODEL_STAGES)  # the config on disk lists them alphabetically
    table = read_summary(out / "summary.tsv")
    for _, rows in table.groupby("variant"):
        assert list(rows.stage) == list(MODEL_STAGES)
    effects = pd.read_csv(out / "effects.tsv", sep="\t")
    for _, rows in effects.groupby("group"):
        assert list(dict.fromkeys(rows.stage)) == list(MODEL_STAGES)


def test_group_is_the_overrides_without_seed():
    assert group_name({}) == group_name({"seed": 7}) == "default"
    assert group_name({"seed": 7, "distill.loss": "reverse_kl"}) == group_name({"distill.loss": "reverse_kl"}) == \
        'distill.loss="reverse_kl"'


def effect(effects, group, stage, metric):
    rows = effects[(effects.group == group) & (effects.stage == stage) & (effects.metric == metric)]
    assert len(rows) == 1, (group, stage, metric, rows)
    return rows.iloc[0]


def test_effects_aggregate_seeds_and_take_deltas_from_the_previous_stage(out):
    effects = pd.read_csv(out / "effects.tsv", sep="\t", dtype={"seeds": str})
    assert list(effects.columns) == list(COLUMNS)
    assert list(dict.fromkeys(effects.group)) == ["default", BETA_GROUP]
    dpo = effect(effects, "default", "dpo", "accuracy")
    values = [accuracy("dpo", seed, None) for seed in (1, 2)]
    deltas = [accuracy("dpo", seed, None) - accuracy("sft", seed, None) for seed in (1, 2)]
    assert dpo.previous == "sft" and dpo.n == 2 and dpo.seeds == "1,2"  # again1 is seed1's model: once
    assert dpo.variants == "again1,seed1,seed2"
    assert (dpo["mean"], dpo["std"]) == pytest.approx((statistics.mean(values), statistics.stdev(values)), abs=TSV)
    assert (dpo["min"], dpo["max"]) == pytest.approx((min(values), max(values)), abs=TSV)
    assert (dpo.delta_mean, dpo.delta_std) == pytest.approx((statistics.mean(deltas), statistics.stdev(deltas)), abs=TSV)
    sft = effect(effects, "default", "sft", "accuracy")
    assert pd.isna(sft.previous) and pd.isna(sft.delta_mean) and pd.isna(sft.delta_std)
    distill = effect(effects, BETA_GROUP, "distill", "accuracy")  # one seed: no spread
    assert distill.previous == "dpo" and distill.n == 1 and pd.isna(distill["std"])
    assert distill.delta_mean == pytest.approx(accuracy("distill", 1, 0.2) - accuracy("dpo", 1, 0.2), abs=TSV)
    assert effect(effects, "default", "grpo", "nll").delta_mean == pytest.approx(1 / 3 - 1 / 2, abs=TSV)
    assert set(effects[effects.metric == "pref_acc"].stage) == {"dpo"}  # a metric a stage lacks has no row
    assert set(effects.metric) == {"accuracy", "pass@1", "pass@2", "reward", "nll", "pref_acc"}


def test_the_base_model_and_the_student_are_stage_zeros_of_the_summary_and_the_effects(tmp_path):
    plan = build_plan(load_config(REPO / "config" / "config.yaml", overrides={
        "results": str(tmp_path / "results"), "ablations": None, "eval": {"base": True}}))
    write_outputs(plan)
    out = tmp_path / "report"
    with pytest.MonkeyPatch.context() as mp:
        run_stage("report", ["--config", plan.report_config_path, "--out", out], mp)
    table = read_summary(out / "summary.tsv")
    assert list(table.stage) == ["base", "sft", "dpo", "grpo", "student", "distill"]
    base = table.iloc[0]
    assert base.accuracy == pytest.approx(accuracy("base", 1234, None), abs=TSV) and base.seed == 1234
    assert pd.isna(base.previous) and pd.isna(base.key) and pd.isna(base.train_steps) and pd.isna(base.train_wall_time_s)
    assert table.iloc[1].previous == "base"
    effects = pd.read_csv(out / "effects.tsv", sep="\t", dtype={"seeds": str})
    sft = effect(effects, "default", "sft", "accuracy")
    assert sft.previous == "base"
    assert sft.delta_mean == pytest.approx(accuracy("sft", 1234, None) - accuracy("base", 1234, None), abs=TSV)
    # Distillation's change is from the student it started from (the teacher's ratio is the docs' to quote).
    student, distill = table[table.stage == "student"].iloc[0], effect(effects, "default", "distill", "accuracy")
    assert pd.isna(student.previous) and pd.isna(student.key) and distill.previous == "student"
    assert distill.delta_mean == pytest.approx(accuracy("distill", 1234, None) - accuracy("student", 1234, None), abs=TSV)


def test_effects_of_a_summary_table_without_files():
    summary = pd.DataFrame([
        {"variant": v, "group": "default", "seed": seed, "stage": stage, "previous": previous,
         "eval_key": f"{stage}{seed}", "accuracy": acc}
        for v, seed, offset in (("a", 1, 0.0), ("b", 2, 0.2))
        for stage, previous, acc in (("grpo", "dpo", 0.5 + offset), ("sft", None, 0.1 + offset), ("dpo", "sft", 0.4))])
    effects = effects_table(summary).set_index("stage")
    assert list(effects.index) == ["sft", "dpo", "grpo"]
    assert effects.loc["dpo", "delta_mean"] == pytest.approx(((0.4 - 0.1) + (0.4 - 0.3)) / 2)
    assert effects.loc["grpo", "delta_std"] == pytest.approx(statistics.stdev([0.5 - 0.4, 0.7 - 0.4]))


def test_objective_curves_follow_the_stage_scripts_keys(plan):
    curves = objective_curves(stage_runs(plan.report_config()["variants"]))
    assert list(curves) == [("sft", "loss"), ("sft", "eval_loss"),
                            ("dpo", "rewards/accuracy"), ("dpo", "rewards/margin"),
                            ("grpo", "reward_mean"), ("grpo", "entropy"),  # no kl: grpo.kl_coef is 0
                            ("distill", "divergence"), ("distill", "eval_divergence")]
    assert len(curves[("sft", "loss")]) == 2  # seed1, again1 and beta share one SFT output; seed2 has its own
    label, steps, values = next(c for c in curves[("sft", "eval_loss")] if "seed2" not in c[0])
    assert label.startswith("seed1, again1, beta (") and steps == [0, 10] and values == [5.0, 0.51]


def test_figures_are_valid_pngs(out):
    for name in FIGURES:
        data = (out / name).read_bytes()
        assert data.startswith(PNG_SIGNATURE), name
        image = matplotlib.image.imread(out / name)
        assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
        assert image[..., :3].std() > 0.01  # not a blank canvas


def test_machine_json_names_cpu_flags_threads_and_commit(out, plan):
    machine = json.loads((out / "machine.json").read_text())
    assert set(machine["isa"]) == set(ISA_FLAGS) and all(isinstance(v, bool) for v in machine["isa"].values())
    assert machine["cpu_model"] and machine["cpu_count"] >= 1 and machine["torch"] == torch.__version__
    assert machine["report_torch_threads"] == torch.get_num_threads()
    sft_keys = {job.key for job in plan.jobs["sft"].values()}
    assert machine["stage_threads"]["sft"] == dict.fromkeys(sft_keys, torch.get_num_threads())
    assert set(machine["stage_threads"]) == {"prepare_data", "sft", "dpo", "reward", "grpo", "distill", "evaluate"}
    assert machine["git_commit"] is None or len(machine["git_commit"].removesuffix("-dirty")) == 40


def test_cpu_flags_come_from_the_first_processor(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Test CPU 9000\nflags\t\t: fpu avx2 avx512f amx_tile\n\n"
                       "processor\t: 1\nmodel name\t: Other\nflags\t\t: avx512_bf16\n")
    assert cpu_model_and_flags(cpuinfo) == ("Test CPU 9000", {"fpu", "avx2", "avx512f", "amx_tile"})


def test_provenance_records_torch_threads(tmp_path):
    assert write_provenance(tmp_path, {"key": "k"}, "sft", time.time(), {})["threads"] == torch.get_num_threads()


def test_readme_table_from_the_report(out, capsys):
    readme_table.main([str(out)])
    printed = capsys.readouterr().out
    assert "nan" not in printed.lower()
    lines = printed.strip().splitlines()
    header, _alignment, *rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[:7]]
    assert header == ["stage", "greedy accuracy", "pass@1", "pass@2", "NLL", "pref_acc", "change from previous stage"]
    assert [row[0] for row in rows] == ["sft, default", f"sft, {BETA_GROUP}", "dpo, default", f"dpo, {BETA_GROUP}",
                                        "grpo, default"]
    sft_values = [accuracy("sft", s, None) for s in (1, 2)]
    assert rows[0][1] == f"{statistics.mean(sft_values):.3f} ± {statistics.stdev(sft_values):.3f}"
    assert rows[1][1] == f"{accuracy('sft', 1, None):.3f}" and rows[0][-1] == "–"  # one seed: no ±; sft: no change
    assert rows[2][-1].startswith("greedy accuracy +0.115 ± 0.007; pass@1 +0.000 ± 0.000;")
    assert rows[2][5] == "0.815 ± 0.007"
    note = lines[-1]
    assert note.startswith("*mean ± std (sample std) over the seeds of each variant group, seeds 1, 2;")
    assert "torch thread" in note and "commit" in note
    assert note.endswith(f"made by `python -m posttrain.report.readme_table {out}`.*")


def test_readme_table_has_one_row_for_a_stage_the_groups_share():
    summary = pd.DataFrame([
        {"variant": v, "group": v, "seed": 1234, "stage": stage, "previous": previous,
         "eval_key": f"{stage}-{v}" if stage == "distill" else stage, "accuracy": acc, "nll": 0.1, "pref_acc": None}
        for v, distilled in (("default", 0.9), ("rkl", 0.8))
        for stage, previous, acc in (("sft", None, 0.7), ("grpo", "sft", 0.6), ("distill", "grpo", distilled))])
    table = readme_table.markdown_table(summary).splitlines()
    assert [line.split("|")[1].strip() for line in table[2:]] == ["sft", "grpo", "distill, default", "distill, rkl"]
    assert "greedy accuracy -0.100" in table[3] and "greedy accuracy +0.200" in table[5]


def test_per_seed_table_shows_each_seeds_value_and_change_where_the_mean_hides_a_loss():
    summary = pd.DataFrame([
        {"variant": f"s{seed}", "group": "default", "seed": seed, "stage": stage, "previous": previous,
         "eval_key": f"{stage}{seed}", "accuracy": acc, "pass@1": acc / 2}
        for seed, rl in ((1, 0.9), (2, 0.3))  # grpo: +0.4 in seed 1, -0.2 in seed 2: +0.1 on average
        for stage, previous, acc in (("sft", None, 0.5), ("grpo", "sft", rl))])
    mean_row = readme_table.markdown_table(summary).splitlines()[3]
    assert "greedy accuracy +0.100" in mean_row
    header, _align, sft, grpo = [[c.strip() for c in line.strip("|").split("|")]
                                 for line in readme_table.seed_table(summary).splitlines()]
    assert header == ["stage", "seed 1", "seed 2"]
    assert sft == ["sft", "greedy accuracy 0.500; pass@1 0.250", "greedy accuracy 0.500; pass@1 0.250"]
    assert grpo == ["grpo", "greedy accuracy 0.900 (+0.400); pass@1 0.450 (+0.200)",
                    "greedy accuracy 0.300 (-0.200); pass@1 0.150 (-0.100)"]


def test_readme_table_update_replaces_only_the_marked_block(out, tmp_path):
    readme = tmp_path / "README.md"
    begin, end = readme_table.markers()
    readme.write_text(f"intro\n{begin}\nold table\n{end}\noutro\n")
    readme_table.main([str(out), "--update", str(readme)])
    text = readme.read_text()
    assert text.startswith(f"intro\n{begin}\n| stage ") and text.endswith(f"{end}\noutro\n")
    assert "old table" not in text and f"--update {readme}`" in text
    readme_table.main([str(out), "--update", str(readme)])
    assert readme.read_text() == text  # a second update changes nothing
    readme.write_text("no markers here\n")
    with pytest.raises(SystemExit, match="README.md: needs the markers <!-- results:begin -->"):
        readme_table.main([str(out), "--update", str(readme)])


def test_a_named_block_takes_the_table_with_each_stages_wall_time(out, tmp_path):
    readme = tmp_path / "README.md"
    results, other = readme_table.markers(), readme_table.markers("smol")
    readme.write_text(f"{results[0]}\nkept\n{results[1]}\n{other[0]}\n{other[1]}\n")
    readme_table.main([str(out), "--update", str(readme), "--block", "smol", "--times", "--per-seed"])
    text = readme.read_text()
    assert f"{results[0]}\nkept\n{results[1]}" in text
    seeds = text[text.index("Per seed"):text.index("Wall time")].splitlines()
    assert seeds[2].startswith("| stage") and "| seed 1" in seeds[2] and "| seed 2" in seeds[2]
    assert f"greedy accuracy {accuracy('sft', 1, None):.3f}; pass@1" in seeds[4]
    rows = [[cell.strip() for cell in line.split("|")[1:4]]
            for line in text[text.index("Wall time"):].splitlines() if line.startswith("| ")]
    # A stage whose outputs no two variant groups share gets a row per group, as in the results table.
    beta = 'distill.teacher_stage="dpo";dpo.beta=0.2'
    split = [f"{stage}, {group}" for stage in ("dpo", "reward", "grpo", "distill") for group in ("default", beta)]
    evals = [f"eval {stage}, {group}" for stage in ("dpo", "grpo", "distill") for group in ("default", beta)]
    assert [row[0] for row in rows] == ["stage", "prepare_data", "sft", *split, "eval sft", *evals, "total per variant"]
    assert rows[rows.index([f"dpo, {beta}", "1", "0.1"])] and rows[-1][1:] == ["4", "0.8 ± 0.0"]  # 4 variants, 10 outputs of 5 s each


def test_stage_times_list_each_output_once_in_pipeline_order(out, plan):
    times = pd.read_csv(out / "stage_times.tsv", sep="\t", dtype={"key": str})
    variants = plan.variants.values()
    expected = ({(job.stage, job.key) for v in variants for job in v.stages.values()}
                | {(f"eval {stage}", job.key) for v in variants for stage, job in v.evals.items()})
    assert len(times) == len(expected) and set(zip(times.stage, times.key)) == expected
    assert list(dict.fromkeys(times.stage)) == ["prepare_data", "sft", "dpo", "reward", "grpo", "distill",
                                                "eval sft", "eval dpo", "eval grpo", "eval distill"]
    assert times.wall_time_s.between(4.9, 6.0).all()  # write_outputs dates every output 5 s after its start
    seed1_sft = plan.variants["seed1"].stages["sft"].key
    assert times[(times.stage == "sft") & (times.key == seed1_sft)].variants.item() == "again1,beta,seed1"


def test_stage_times_keep_on_policy_dpo_pairs_beside_grpo_reward(tmp_path):
    """Both reward scorings of a variant get a row: the one DPO's pairs come from (sampled from SFT) just before
    dpo, grpo's own (sampled from DPO) in its place; the manifest used to keep only the last one."""
    cfg = load_config(REPO / "config" / "config.yaml", overrides={"results": str(tmp_path / "results"),
                                                                   "dpo": {"pairs": "on_policy"}})
    plan = build_plan(cfg)
    write_outputs(plan)
    variant = plan.variants["default"]
    times = stage_time_table(plan.report_config()["variants"])
    assert list(times.stage[:6]) == ["prepare_data", "sft", "dpo_pairs", "dpo", "reward", "grpo"]
    keys = dict(zip(times.stage, times.key))
    assert keys["dpo_pairs"] == variant.stages["dpo"].inputs["pairs"].key != keys["reward"]
    assert keys["reward"] == variant.stages["grpo"].inputs["reward"].key


def test_missing_eval_output_is_named(tmp_path, monkeypatch):
    plan = make_plan(tmp_path)
    write_outputs(plan)
    missing = plan.variants["beta"].evals["dpo"]
    (tmp_path / "results" / "eval" / missing.key / "metrics.json").unlink()
    with pytest.raises(FileNotFoundError, match=f"{missing.key}/metrics.json"):
        run_stage("report", ["--config", plan.report_config_path, "--out", tmp_path / "report"], monkeypatch)
    assert not (tmp_path / "report").exists()


def test_report_config_without_previous_stages_is_named(tmp_path, plan, monkeypatch):
    cfg = plan.report_config()
    del cfg["variants"]["beta"]["previous"]
    path = tmp_path / "report.config.json"
    path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=f"{path}: variant 'beta' lacks previous"):
        run_stage("report", ["--config", path, "--out", tmp_path / "report"], monkeypatch)
    assert not (tmp_path / "report").exists()
