# results/variants/<name>/: manifest.json (stage -> key and path) and a link per output.


rule variant:
    input:
        lambda wildcards: [job.path for job in PLAN.variants[wildcards.variant].jobs()],
    output:
        directory(f"{RESULTS}/variants/{{variant}}"),
    params:
        manifest=lambda wildcards: canonical_json(PLAN.variants[wildcards.variant].manifest()),
        launch=launcher,
    log:
        f"{RESULTS}/logs/variants/{{variant}}.log",
    localrule: True
    conda:
        "../../envs/cuda.yaml"
    shell:
        "{params.launch} -m posttrain.workflow.views --manifest {params.manifest:q} --out {output:q} > {log:q} 2>&1"
