"""Plain PyTorch twins of every op: the ground truth that tests and the bench compare against."""
