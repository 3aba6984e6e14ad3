"""The ranking models and their inputs: features, Wide&Deep and the light model, the attention
rankers, pruning, routing by item heat, and the versioned model files."""
