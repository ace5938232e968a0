"""`moestream bench decode|kernels|serve|capped`: benchmarks that print ratios measured in one run."""
