rule grpo:
    input:
        unpack(stage_inputs("grpo")),
    output:
        stage_output("grpo"),
    params:
        script=script("grpo"),
        launch=launcher,
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
        "{params.launch} {params.script:q} --config {input.config:q} --out {output:q}"
        " --data {input.data:q} --model {input.model:q} --reward {input.reward:q} > {log:q} 2>&1"
