"""What a model file says without loading its weights: hyper-parameters, the default model.

Torch-free on purpose: the coordinator reads these (context length, tokenizer location) and
must start without the engine's dependencies.
"""
