"""Reading Snakemake's console output in tests."""

from __future__ import annotations

from collections import Counter


def job_counts(output: str) -> Counter:
    """Jobs per rule from the "Job stats" table Snakemake prints before running (or dry-running) a DAG;
    empty when there is nothing to do."""
    if "Nothing to be done" in output or "Job stats:" not in output:
        return Counter()
    counts = Counter()
    for line in output.split("Job stats:")[1].splitlines()[3:]:
        words = line.split()
        if len(words) != 2 or words[0] == "total":
            break
        counts[words[0]] = int(words[1])
    return counts
