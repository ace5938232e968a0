"""Decoder process: torch models whose experts come from moestream-iod or are resident."""
