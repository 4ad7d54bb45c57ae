rule sft:
    input:
        unpack(stage_inputs("sft")),
    output:
        stage_output("sft"),
    params:
        script=script("sft"),
        launch=launcher,
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
        "{params.launch} {params.script:q} --config {input.config:q} --out {output:q}"
        " --data {input.data:q} > {log:q} 2>&1"
