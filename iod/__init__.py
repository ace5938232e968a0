"""moestream-iod: the per-host daemon that reads expert blocks into a shared-memory arena."""
