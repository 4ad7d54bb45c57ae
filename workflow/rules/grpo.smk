rule grpo:
    input:
        unpack(stage_inputs("grpo")),
    output:
        stage_output("grpo"),
    params:
        script=script("grpo"),
        launch=launcher,
        args=stage_args,
    threads: stage_threads("grpo")
    resources:
        **stage_resources("grpo"),
    log:
        stage_log("grpo"),
    benchmark:
        stage_benchmark("grpo")
    conda:
        "../../envs/cuda.yaml"
    shell:
        "{params.launch} {params.script:q} {params.args} > {log:q} 2>&1"
