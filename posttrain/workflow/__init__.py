"""What the Snakemake workflow (Snakefile, workflow/*.smk) runs at parse time, as plain Python.

`config`: schema validation with messages that name the key; `ablations`: the variant table;
`plan`: stage keys and the job graph of all variants; `launch`: the command prefix a rule's
resources imply; `views`: the small files the workflow writes itself. Importing this package
never imports torch, so planning stays fast.
"""
