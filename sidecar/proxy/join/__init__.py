"""The join of captured rollouts with trainer reports, its endpoints and its peers."""
