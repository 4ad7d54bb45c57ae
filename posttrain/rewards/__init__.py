"""Rewards for preference data and RL: rule-based verifiers and their scoring."""

from posttrain.rewards.verifiers import (
    FINAL_ANSWER_MARKER,
    TASK_VERIFIERS,
    VERIFIERS,
    Verifier,
    VerifierError,
    extract_answer,
    extract_list,
    extract_number,
    final_answer_text,
    format_reward,
    list_match,
    load_verifier,
    load_verifiers,
    number_match,
    score,
    task_verifier,
)

__all__ = [
    "FINAL_ANSWER_MARKER",
    "TASK_VERIFIERS",
    "VERIFIERS",
    "Verifier",
    "VerifierError",
    "extract_answer",
    "extract_list",
    "extract_number",
    "final_answer_text",
    "format_reward",
    "list_match",
    "load_verifier",
    "load_verifiers",
    "number_match",
    "score",
    "task_verifier",
]
