"""Tool calls in the families' own formats: which one a chat template speaks, how a reply's text
splits into content and calls (vLLM's tool parsers do the same per family), and the grammar that
forces a call for `tool_choice` required or named.

| format | families | a call in the reply's text |
|---|---|---|
| hermes | Qwen2.5/3/3.5, Hermes, OLMoE | `<tool_call>\\n{"name": N, "arguments": {...}}\\n</tool_call>` (repeatable) |
| harmony | gpt-oss | `<\\|channel\\|>commentary to=functions.N <\\|constrain\\|>json<\\|message\\|>{...}` ending at `<\\|call\\|>` |
| glm | GLM-4.5/4.6 | `<tool_call>N\\n<arg_key>k</arg_key>\\n<arg_value>v</arg_value>\\n...</tool_call>` |
| deepseek | DeepSeek-V3/V3.1/R1 | `<｜tool▁call▁begin｜>[function<｜tool▁sep｜>]N...{...}<｜tool▁call▁end｜>` |
| mistral | Mistral, Mixtral | `[TOOL_CALLS][{"name": N, "arguments": {...}}, ...]` |

The format is chosen from the marker the template writes (a template without one cannot show the
model its tools). Forced calls (required / named) are built for hermes and harmony; the other
formats parse what the model writes under `auto` and refuse a forced choice with a 400.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

# format -> the text that opens a call in a reply
MARKERS: dict[str, str] = {
    "harmony": "to=functions.",
    "glm": "<tool_call>",
    "deepseek": "<｜tool▁calls▁begin｜>",
    "hermes": "<tool_call>",
    "mistral": "[TOOL_CALLS]",
}
_DETECT = (("harmony", "to=functions"), ("deepseek", "<｜tool▁calls▁begin｜>"), ("glm", "<arg_key>"),
           ("hermes", "<tool_call>"), ("mistral", "[TOOL_CALLS]"))
FORCEABLE = ("hermes", "harmony")


class ToolError(ValueError):
    pass


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = ""

    def json(self, index: int | None = None) -> dict[str, Any]:
        d: dict[str, Any] = {"id": self.id, "type": "function",
                             "function": {"name": self.name, "arguments": self.arguments}}
        return d if index is None else {"index": index, **d}


def detect_format(template: str | None) -> str | None:
    """The tool-call format a chat template writes, or None (it cannot show tools)."""
    for fmt, marker in _DETECT:
        if template and marker in template:
            return fmt
    return None


def _call(name: str, args: Any) -> ToolCall:
    text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return ToolCall(name, text, "call_" + uuid.uuid4().hex[:24])


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def parse(fmt: str, text: str) -> tuple[str, list[ToolCall]]:
    """A whole reply -> (content, complete calls); a call that does not parse stays content."""
    calls, content = PARSERS[fmt](text)
    if fmt == "harmony":  # the reply is channels: its content is the final channel's text
        return content.strip(), calls
    return content.strip() if calls else text, calls


def _hermes(text: str) -> tuple[list[ToolCall], str]:
    calls, kept = [], text
    for m in re.finditer(r"<tool_call>\s*(.*?)\s*</tool_call>", text, re.S):
        obj = _json(m.group(1))
        if isinstance(obj, dict) and isinstance(obj.get("name"), str):
            calls.append(_call(obj["name"], obj.get("arguments", {})))
            kept = kept.replace(m.group(0), "", 1)
    return calls, kept


def _harmony(text: str) -> tuple[list[ToolCall], str]:
    calls = []
    pat = r"to=functions\.([\w.\-]+)[^<]*(?:<\|constrain\|>\w*)?<\|message\|>(.*?)(?:<\|call\|>|<\|end\|>|$)"
    for m in re.finditer(pat, text, re.S):
        if _json(m.group(2).strip()) is not None:
            calls.append(_call(m.group(1), m.group(2).strip()))
    final = re.search(r"<\|channel\|>final<\|message\|>(.*?)(?:<\|end\|>|<\|return\|>|$)", text, re.S)
    content = final.group(1) if final else text[:text.find("<|channel|>")] if "<|channel|>" in text else text
    return calls, content


def _glm(text: str) -> tuple[list[ToolCall], str]:
    calls, kept = [], text
    for m in re.finditer(r"<tool_call>\s*([^\n<]+)\s*(.*?)</tool_call>", text, re.S):
        pairs = re.findall(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", m.group(2), re.S)
        args = {k.strip(): (_json(v) if _json(v) is not None else v) for k, v in pairs}
        calls.append(_call(m.group(1).strip(), args))
        kept = kept.replace(m.group(0), "", 1)
    return calls, kept


def _deepseek(text: str) -> tuple[list[ToolCall], str]:
    calls = []
    pat = (r"<｜tool▁call▁begin｜>(?:function<｜tool▁sep｜>([^\n]+)\n```json\n(.*?)\n```"
           r"|([^<]+?)<｜tool▁sep｜>(.*?))<｜tool▁call▁end｜>")
    for m in re.finditer(pat, text, re.S):
        name, args = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
        if _json(args) is not None:
            calls.append(_call(name.strip(), args.strip()))
    cut = text.find(MARKERS["deepseek"])
    return calls, text[:cut] if cut >= 0 else text


def _mistral(text: str) -> tuple[list[ToolCall], str]:
    cut = text.find("[TOOL_CALLS]")
    if cut < 0:
        return [], text
    items = _json(text[cut + len("[TOOL_CALLS]"):].strip())
    items = [items] if isinstance(items, dict) else items if isinstance(items, list) else []
    calls = [_call(i["name"], i.get("arguments", {})) for i in items if isinstance(i, dict) and "name" in i]
    return calls, text[:cut]


PARSERS = {"hermes": _hermes, "harmony": _harmony, "glm": _glm, "deepseek": _deepseek, "mistral": _mistral}


# -- forcing a call -------------------------------------------------------------------------------
def _lit(s: str) -> str:
    return json.dumps(s)


def _compact(schema: dict) -> str:
    """A schema for Lark's %json, asking for compact JSON (no free whitespace) as JSON_OPTIONS does."""
    return json.dumps({**schema, "x-guidance": {"whitespace_flexible": False}})


def forced_grammar(fmt: str, tools: list[dict], parallel: bool) -> str:
    """A Lark grammar (llguidance dialect) whose only sentences are calls of `tools` in `fmt`."""
    if fmt not in FORCEABLE:
        raise ToolError(f"tool_choice required / named is not supported for the {fmt} tool format "
                        f"(supported: {', '.join(FORCEABLE)}); use tool_choice auto")
    if fmt == "hermes":
        schema = {"anyOf": [{"type": "object", "properties": {"name": {"const": t["name"]},
                                                              "arguments": t["parameters"]},
                             "required": ["name", "arguments"], "additionalProperties": False} for t in tools]}
        call = f'"<tool_call>\\n" %json {_compact(schema)} "\\n</tool_call>"'
        return f"start: call{'+' if parallel else ''}\ncall: {call}\n"
    alts = " | ".join(f'{_lit(t["name"] + " <|constrain|>json<|message|>")} %json {_compact(t["parameters"])}'
                      for t in tools)
    return f'start: {_lit("<|channel|>commentary to=functions.")} ({alts})\n'


def function_tools(tools: Any) -> list[dict]:
    """OpenAI's `tools` list checked: [{name, description, parameters}] of its functions."""
    if not isinstance(tools, list) or not tools:
        raise ToolError("tools must be a non-empty list of {type: function, function: {...}}")
    out = []
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
            raise ToolError(f"tools[{i}] must be {{type: function, function: {{name, parameters}}}}")
        params = f.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise ToolError(f"tools[{i}].function.parameters must be a JSON schema object")
        out.append({"name": f["name"], "description": f.get("description", ""), "parameters": params})
    return out


def chosen_tools(tools: list[dict], choice: Any) -> tuple[str, list[dict]]:
    """tool_choice -> (mode, the tools a forced call may use); mode: none | auto | forced."""
    if choice is None or choice in ("auto", "none"):
        return choice or "auto", tools
    if choice == "required":
        return "forced", tools
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    picked = [t for t in tools if t["name"] == name]
    if not picked:
        raise ToolError(f"tool_choice must be none, auto, required or {{type: function, function: {{name}}}} "
                        f"naming one of the tools, got {json.dumps(choice)}")
    return "forced", picked


# -- streaming --------------------------------------------------------------------------------------
class ToolStream:
    """A streamed reply split into content, shown as it comes, and calls, each sent once complete.

    Text from a call's marker on is held back (so a client never sees a call as content); formats
    whose calls close with a tag (hermes, glm, deepseek) send each call as it closes, the others
    (harmony, mistral: a call ends with the reply) at the end. Held text that turns out not to be a
    call is sent as content at the end."""

    def __init__(self, fmt: str):
        self.fmt, self.marker = fmt, "<|channel|>" if fmt == "harmony" else MARKERS[fmt]
        self.text, self.sent, self.in_call, self.n_calls = "", 0, False, 0

    def add(self, piece: str) -> tuple[str, list[ToolCall]]:
        self.text += piece
        if not self.in_call:
            cut = self.text.find(self.marker, self.sent)
            if cut < 0:
                end = len(self.text) - _partial_suffix(self.text[self.sent:], self.marker)
                out, self.sent = self.text[self.sent:end], end
                return out, []
            out, self.sent, self.in_call = self.text[self.sent:cut], cut, True
            return out, self._new_calls()
        return "", self._new_calls()

    def _new_calls(self) -> list[ToolCall]:
        if self.fmt in ("harmony", "mistral"):
            return []
        calls = PARSERS[self.fmt](self.text[self.sent:])[0][self.n_calls:]
        self.n_calls += len(calls)
        return calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The reply ended: the calls not sent yet, and held text that was no call."""
        if not self.in_call:
            return self.text[self.sent:], []
        content, calls = parse(self.fmt, self.text[self.sent:])
        if not calls and not self.n_calls and self.fmt != "harmony":
            return self.text[self.sent:], []
        return (content if self.fmt == "harmony" else ""), calls[self.n_calls:]


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
