"""Evaluation metrics: pass@k, task accuracy and reward, held-out NLL, implicit preference accuracy."""

from posttrain.evaluation.likelihood import eval_pairs, heldout_nll, implicit_preference_accuracy
from posttrain.evaluation.passk import mean_pass_at_k, pass_at_k
from posttrain.evaluation.task_metrics import PromptResult, is_correct, task_metrics

__all__ = [
    "PromptResult",
    "eval_pairs",
    "heldout_nll",
    "implicit_preference_accuracy",
    "is_correct",
    "mean_pass_at_k",
    "pass_at_k",
    "task_metrics",
]
