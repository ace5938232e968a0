"""`make-model --mix`: per-tensor expert quant types, as dynamic low-bit quants ship them.

A mix is comma-separated `KEY=TYPE` rules:

  gate=T, up=T, down=T   that part of every layer's experts (a fused gate_up tensor takes gate's)
  gate_up=T              gate and up (and a fused gate_up tensor)
  layers:A=T, layers:A-B=T   every expert part of layers A..B (inclusive): wins over part rules

e.g. `gate_up=Q2_K,down=Q4_K,layers:0-1=Q8_0`. Experts no rule names keep --expert-quant
(else --quant). Norms, routers and biases stay F32 whatever the mix says.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from gguf import GGMLQuantizationType as Q

from .quantize import ENCODABLE, qtype_of, writable

PARTS = ("gate", "up", "down")
_LAYERS = re.compile(r"^layers:(\d+)(?:-(\d+))?$")
_EXPERT = re.compile(r"^blk\.(\d+)\.ffn_(gate_up|gate|up|down)_exps\.weight$")
KEYS_HELP = "gate, up, down, gate_up, layers:A or layers:A-B"


@dataclass(frozen=True)
class QuantMix:
    """Parsed rules: part -> type, and (first, last, type) layer ranges (later ranges win)."""

    parts: dict[str, Q] = field(default_factory=dict)
    layers: tuple[tuple[int, int, Q], ...] = ()

    def expert_qtype(self, name: str, default: Q) -> Q:
        """The type of expert tensor `name` (blk.L.ffn_<part>_exps.weight); `default` if no rule names it."""
        m = _EXPERT.match(name)
        if m is None:
            return default
        layer, part = int(m.group(1)), m.group(2)
        for first, last, q in reversed(self.layers):
            if first <= layer <= last:
                return q
        return self.parts.get("gate" if part == "gate_up" else part, default)

    def qtypes(self) -> set[Q]:
        return set(self.parts.values()) | {q for *_, q in self.layers}

    def check_layers(self, n_layer: int) -> None:
        for first, last, _ in self.layers:
            if last >= n_layer:
                raise ValueError(f"--mix: layers:{first}-{last} is past the model's {n_layer} layers (0-{n_layer - 1})")


def parse_mix(text: str) -> QuantMix:
    """`"gate_up=Q2_K,down=Q4_K,layers:0-1=Q8_0"` -> QuantMix; ValueError naming the bad rule."""
    parts: dict[str, Q] = {}
    layers: list[tuple[int, int, Q]] = []
    for rule in (r.strip() for r in text.split(",")):
        key, sep, value = rule.partition("=")
        key = key.strip()
        if not sep or not key or not value.strip():
            raise ValueError(f"--mix: {rule!r} is not KEY=TYPE (keys: {KEYS_HELP})")
        try:
            q = qtype_of(value.strip())
        except ValueError as e:
            raise ValueError(f"--mix: {rule!r}: {e}") from None
        if q not in ENCODABLE:
            raise ValueError(f"--mix: {rule!r}: cannot write {q.name} (writable: {writable()})")
        if key == "gate_up":
            parts.update(gate=q, up=q)
        elif key in PARTS:
            parts[key] = q
        elif (m := _LAYERS.match(key)) is not None:
            first, last = int(m.group(1)), int(m.group(2) or m.group(1))
            if last < first:
                raise ValueError(f"--mix: {rule!r}: empty layer range {first}-{last}")
            layers.append((first, last, q))
        else:
            raise ValueError(f"--mix: {rule!r}: unknown key {key!r} (keys: {KEYS_HELP})")
    return QuantMix(parts, tuple(layers))
