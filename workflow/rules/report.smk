# One summary over every variant's evals: results/report/ (summary.tsv, effects.tsv, figures,
# machine.json). Its config lists each variant's manifest (stage -> key and path, eval -> key and
# path, previous model stage). Every table and figure goes into `snakemake --report` with its caption.
rule report:
    input:
        config=PLAN.report_config_path,
        evals=PLAN.eval_paths(),
    output:
        report(
            directory(f"{RESULTS}/report"),
            patterns=["{name}.png", "{name}.tsv", "{name,machine}.json"],
            caption="../report/results.rst",
            category="Results",
            labels={"file": "{name}"},
        ),
    params:
        script=script("report"),
        launch=launcher,
    log:
        f"{RESULTS}/logs/report.log",
    benchmark:
        f"{RESULTS}/benchmarks/report.tsv"
    localrule: True
    conda:
        "../../envs/cuda.yaml"
    shell:
        "{params.launch} {params.script:q} --config {input.config:q} --out {output:q} > {log:q} 2>&1"
