"""One module per architecture."""
