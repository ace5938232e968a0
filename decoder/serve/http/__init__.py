"""The HTTP side of `moestream serve`: routes, OpenAI's request and response shapes, metrics."""
