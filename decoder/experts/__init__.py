"""The expert path of a decoder: where a MoE block's experts are computed (resident, arena, device slots), prefetch."""
