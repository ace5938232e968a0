"""`moestream bench capped`: daemon + decoder under one memory cap, beside llama.cpp."""
