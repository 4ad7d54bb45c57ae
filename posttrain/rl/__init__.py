"""GRPO plumbing: rollout collection and scoring, training batches, the bounded-staleness buffer,
the sync (in-process) and async (Ray generator actors) collectors, and weight sync."""
