rule prepare_data:
    input:
        unpack(stage_inputs("prepare_data")),
    output:
        stage_output("prepare_data"),
    params:
        script=script("prepare_data"),
        launch=launcher,
        args=stage_args,
    threads: stage_threads("prepare_data")
    resources:
        **stage_resources("prepare_data"),
    log:
        stage_log("prepare_data"),
    benchmark:
        stage_benchmark("prepare_data")
    conda:
        "../../envs/cuda.yaml"
    shell:
        "{params.launch} {params.script:q} {params.args} > {log:q} 2>&1"
