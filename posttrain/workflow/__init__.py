"""What the Snakemake workflow (Snakefile, workflow/*.smk) runs at parse time, as plain Python.

`config`: schema validation with messages that name the key; `ablations`: the variant table;
`plan`: stage keys and the job graph of all variants; `fingerprint`: the config keys a stage
script declares and the hash of the code it runs; `reasons`: why a stage reruns under a new key;
`launch`: the command prefix a rule's resources imply; `views`: the small files the workflow
writes itself. `layout` (the stages and their result folders) and `lineage` (an output's chain of
`posttrain.json` records) are also read by stages. Importing this package never imports torch,
so planning stays fast.
"""
