# One rule per stage of posttrain.workflow.layout.STAGE_DIRS, named after it: the resolved config and the upstream
# outputs it reads (stage_inputs; the flags the script declares in INPUTS) in, <results>/<stage dir>/<key>/ out,
# stages/<stage>.py run by the launcher its resources ask for. The stages differ only in their name: the graph
# lives in the plan (posttrain.workflow.plan), so e.g. distill's teacher (distill.teacher_stage), export's model
# (export.stage) and each evaluated model (one evaluate job per model stage of a variant) are the plan's inputs.
for stage in STAGE_DIRS:

    rule:
        name:
            stage
        input:
            unpack(stage_inputs(stage)),
        output:
            stage_output(stage),
        params:
            script=script(stage),
            launch=launcher,
            args=stage_args,
        threads: stage_threads(stage)
        resources:
            **stage_resources(stage),
        log:
            stage_log(stage),
        benchmark:
            stage_benchmark(stage)
        conda:
            "../../envs/cuda.yaml"
        shell:
            "{params.launch} {params.script:q} {params.args} > {log:q} 2>&1"
