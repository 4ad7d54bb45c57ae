# Teacher: the output of distill.teacher_stage (default grpo); student: model.student.
rule distill:
    input:
        unpack(stage_inputs("distill")),
    output:
        stage_output("distill"),
    params:
        script=script("distill"),
        launch=launcher,
        args=stage_args,
    threads: stage_threads("distill")
    resources:
        **stage_resources("distill"),
    log:
        stage_log("distill"),
    benchmark:
        stage_benchmark("distill")
    conda:
        "../../envs/cuda.yaml"
    shell:
        "{params.launch} {params.script:q} {params.args} > {log:q} 2>&1"
