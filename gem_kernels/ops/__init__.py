"""Front doors of the op families: torch.library definitions, fake kernels, autograd, validation."""
