"""One module per model family: how its config and tensors map onto the shared layout."""
