# One job per evaluated model (sft, dpo, grpo, distill of each variant), keyed by the eval
# settings and the model's key: results/eval/<key>/metrics.json.
rule evaluate:
    input:
        unpack(stage_inputs("evaluate")),
    output:
        stage_output("evaluate"),
    params:
        script=script("evaluate"),
        launch=launcher,
        args=stage_args,
    threads: stage_threads("evaluate")
    resources:
        **stage_resources("evaluate"),
    log:
        stage_log("evaluate"),
    benchmark:
        stage_benchmark("evaluate")
    conda:
        "../../envs/cuda.yaml"
    shell:
        "{params.launch} {params.script:q} {params.args} > {log:q} 2>&1"
