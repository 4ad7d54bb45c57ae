"""Distillation pieces the stage composes: one vocabulary for teacher and student, the KD loss, sampled completions."""

from posttrain.distill.loss import distill_loss
from posttrain.distill.sampling import SampledBatches, completion_batch, sampling_model
from posttrain.distill.vocabulary import VocabularyMismatchError, check_same_vocabulary, parameter_count, student_config

__all__ = [
    "SampledBatches",
    "VocabularyMismatchError",
    "check_same_vocabulary",
    "completion_batch",
    "distill_loss",
    "parameter_count",
    "sampling_model",
    "student_config",
]
