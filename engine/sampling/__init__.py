"""Token selection for a batch: temperature, top-k/p, min-p, penalties and masks, in torch.

The parameters a request asks for (`shared.sampling.params`) are torch-free and cross the
wire; this package applies them to logits.
"""
