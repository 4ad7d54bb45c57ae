# The Bradley-Terry reward model (reward_model.source: train), from the policy GRPO starts from: results/reward_model/<key>/.
rule reward_model:
    input:
        unpack(stage_inputs("reward_model")),
    output:
        stage_output("reward_model"),
    params:
        script=script("reward_model"),
        launch=launcher,
        args=stage_args,
    threads: stage_threads("reward_model")
    resources:
        **stage_resources("reward_model"),
    log:
        stage_log("reward_model"),
    benchmark:
        stage_benchmark("reward_model")
    conda:
        "../../envs/cuda.yaml"
    shell:
        "{params.launch} {params.script:q} {params.args} > {log:q} 2>&1"
