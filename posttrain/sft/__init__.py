"""Supervised fine-tuning: the step of `stages/sft.py` (`posttrain.sft.step`)."""
