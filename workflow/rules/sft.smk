rule sft:
    input:
        unpack(stage_inputs("sft")),
    output:
        stage_output("sft"),
    params:
        script=script("sft"),
        launch=launcher,
        args=stage_args,
    threads: stage_threads("sft")
    resources:
        **stage_resources("sft"),
    log:
        stage_log("sft"),
    benchmark:
        stage_benchmark("sft")
    conda:
        "../../envs/cuda.yaml"
    shell:
        "{params.launch} {params.script:q} {params.args} > {log:q} 2>&1"
