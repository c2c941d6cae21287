"""oldlogit's benchmark suite (`oldlogit bench`): ratios measured side by side in one run."""
