"""PyTorch: tensors, ``nn.Module`` policies through autocast regions, the loss-scale optimizer."""
