"""TorchRec integration: sharders (branch dist); the collections come from branch torchrec."""
