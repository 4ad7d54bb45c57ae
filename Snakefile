# posttrain: data -> SFT -> DPO -> reward -> GRPO -> distill, eval of every model, export, report.
# Run: snakemake --profile profiles/local   (docs/workflow.md: Slurm, sweeps, where results are)

configfile: "config/config.yaml"


report: "workflow/report/workflow.rst"


include: "workflow/common.smk"


rule all:
    input:
        f"{RESULTS}/report",
        [f"{RESULTS}/variants/{name}" for name in PLAN.variants],


include: "workflow/rules/stages.smk"
include: "workflow/rules/report.smk"
include: "workflow/rules/variants.smk"
