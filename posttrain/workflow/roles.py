"""Names a variant gives a job besides its stage name (a manifest's `stages` entries, its view's links).

A leaf module of its own, not `layout`: every stage's code fingerprint covers `layout`, so a name
added there would move every stage's key; this one is read by the planner and the report only.
"""

# The reward scoring that samples on-policy DPO's pairs (`dpo.pairs: on_policy`) from the model DPO starts
# from, beside grpo's own `reward`.
DPO_PAIRS = "dpo_pairs"
