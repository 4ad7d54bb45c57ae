rule reward:
    input:
        unpack(stage_inputs("reward")),
    output:
        stage_output("reward"),
    params:
        script=script("reward"),
        launch=launcher,
        args=stage_args,
    threads: stage_threads("reward")
    resources:
        **stage_resources("reward"),
    log:
        stage_log("reward"),
    benchmark:
        stage_benchmark("reward")
    conda:
        "../../envs/cuda.yaml"
    shell:
        "{params.launch} {params.script:q} {params.args} > {log:q} 2>&1"
