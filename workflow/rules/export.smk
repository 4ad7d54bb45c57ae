# The model of export.stage (default distill), converted for deployment (and pushed if asked);
# its model card quotes that model's eval.
rule export:
    input:
        unpack(stage_inputs("export")),
    output:
        stage_output("export"),
    params:
        script=script("export"),
        launch=launcher,
        args=stage_args,
    threads: stage_threads("export")
    resources:
        **stage_resources("export"),
    log:
        stage_log("export"),
    benchmark:
        stage_benchmark("export")
    conda:
        "../../envs/cuda.yaml"
    shell:
        "{params.launch} {params.script:q} {params.args} > {log:q} 2>&1"
