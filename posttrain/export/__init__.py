"""Export helpers: model card, torchao int8 copy, hub push."""
