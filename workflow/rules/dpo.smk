rule dpo:
    input:
        unpack(stage_inputs("dpo")),
    output:
        stage_output("dpo"),
    params:
        script=script("dpo"),
        launch=launcher,
        args=stage_args,
    threads: stage_threads("dpo")
    resources:
        **stage_resources("dpo"),
    log:
        stage_log("dpo"),
    benchmark:
        stage_benchmark("dpo")
    conda:
        "../../envs/cuda.yaml"
    shell:
        "{params.launch} {params.script:q} {params.args} > {log:q} 2>&1"
