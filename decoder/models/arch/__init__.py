"""One module per architecture over the generic `moe_transformer.MoETransformer`."""
