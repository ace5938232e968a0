"""GPU expert backends: the device slot cache (`gpu-slots`) and zero-copy arena experts (`gpu-arena`)."""
