"""A request's tools: their checks, and the JSON schema that forces calls (tool_choice "required" or a
named function) through constrained decoding. The output it forces is read by
tool_parsers.parse_forced_calls."""

from __future__ import annotations

import json
import re
from typing import Any

from lmserve.structured import unenforced_schema

NAME_RE = re.compile(r"[a-zA-Z0-9_-]{1,64}")
EMPTY_PARAMETERS = {"type": "object", "properties": {}}
DEFINITION_KEYS = ("$defs", "definitions")  # where a schema keeps what its "$ref"s point to


def check_tools(tools: Any) -> list[dict[str, Any]]:
    """A request's tools, checked (ValueError naming the field): each {"type": "function", "function":
    {"name", "description"?, "parameters"?}}. Returns them with parameters an object schema (an empty
    one where none was given)."""
    if not isinstance(tools, list):
        raise ValueError("tools: must be a list")
    try:  # (how many and how large: the server's limits, --max-tools / --max-schema-bytes)
        json.dumps(tools, allow_nan=False)
    except (TypeError, ValueError):
        raise ValueError("tools: must be JSON") from None
    out, seen = [], set()
    for i, t in enumerate(tools):
        at = f"tools[{i}]"
        if not isinstance(t, dict):
            raise ValueError(f"{at}: must be an object")
        if t.get("type") != "function":
            raise ValueError(f"{at}.type: must be 'function', got {t.get('type')!r}")
        fn = t.get("function")
        if not isinstance(fn, dict):
            raise ValueError(f"{at}.function: must be an object")
        name = fn.get("name")
        if not isinstance(name, str) or not NAME_RE.fullmatch(name):
            raise ValueError(f"{at}.function.name: must be 1 to 64 of a-z, A-Z, 0-9, _ and -, got {name!r}")
        if name in seen:
            raise ValueError(f"{at}.function.name: {name!r} names an earlier tool too")
        seen.add(name)
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise ValueError(f"{at}.function.description: must be a string")
        params = fn.get("parameters")
        if params is None:
            params = dict(EMPTY_PARAMETERS)
        elif not isinstance(params, dict) or params.get("type", "object") != "object":
            raise ValueError(f"{at}.function.parameters: must be a JSON schema of type 'object'")
        for key in DEFINITION_KEYS:
            if not isinstance(params.get(key, {}), dict):
                raise ValueError(f"{at}.function.parameters.{key}: must be an object")
        out.append({"type": "function", "function": {**fn, "parameters": {"type": "object", **params}}})
    return out


def tools_json_schema(tools: Any, mode: str | dict[str, Any], parallel: bool = True) -> dict[str, Any]:
    """The JSON schema of an output that is nothing but calls, for tool_choice "required" (mode
    "required": any of the tools) or one function (mode its name, or the tool_choice object
    {"type": "function", "function": {"name": ...}}; a function named "required" needs the object).

    Shape: [{"name": <one of the names>, "arguments": <that function's parameters>}, ...], at least one
    call, at most one unless parallel (and tool_choice "required"); each function's parameters are a root
    definition of their own (`_rebased`: their references resolve as in the function alone, and two tools may
    define one name differently).
    `parse_forced_calls` reads such an output."""
    tools = check_tools(tools)
    if not tools:
        raise ValueError("tools: must not be empty when tool_choice is 'required' or names a function")
    if isinstance(mode, dict):
        fn = mode.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if mode.get("type") != "function" or not isinstance(name, str):
            raise ValueError("tool_choice: must be 'none', 'auto', 'required' or "
                             "{'type': 'function', 'function': {'name': ...}}")
        mode = name
    chosen = [(i, t["function"]) for i, t in enumerate(tools)
              if mode == "required" or t["function"]["name"] == mode]
    if not chosen:
        raise ValueError(f"tool_choice.function.name: no tool is a function named {mode!r}")
    # each chosen function's parameters become a root definition of their own, their definitions beside them
    # under names of their own, every "$ref" rewritten to match: "#" and "#/properties/..." (root-relative, as
    # OpenAI's recursive schemas write them) and "#/$defs/x" (pydantic's) resolve as in the function alone
    defs: dict[str, Any] = {}
    items = []
    for i, fn in chosen:
        if (problem := unenforced_schema(fn["parameters"])):  # (named here: the compile sees it as $defs.tool{i})
            raise ValueError(f"tools[{i}].function.parameters: {problem}")
        params = dict(fn["parameters"])
        found = [(key, name, d) for key in DEFINITION_KEYS for name, d in (params.pop(key, None) or {}).items()]
        names = {(key, name): f"tool{i}_def{j}" for j, (key, name, _) in enumerate(found)}  # (no pointer escapes)
        for key, name, d in found:
            defs[names[key, name]] = _rebased(d, i, names)
        defs[_def_name(i)] = _rebased(params, i, names)
        items.append({"type": "object", "properties": {"name": {"type": "string", "enum": [fn["name"]]},
                                                       "arguments": {"$ref": f"#/$defs/{_def_name(i)}"}},
                      "required": ["name", "arguments"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "items": items[0] if len(items) == 1 else {"anyOf": items},
                              "minItems": 1, "$defs": defs}
    if not parallel or mode != "required":  # a named function: exactly one call, as OpenAI and vLLM make
        schema["maxItems"] = 1
    return schema


def _def_name(i: int) -> str:
    """The root definition that tools[i]'s parameters become."""
    return f"tool{i}"


DATA_KEYS = frozenset({"const", "enum", "default", "examples"})  # values, not schemas: never rewritten
NAME_MAPS = frozenset({"properties", "patternProperties", "dependentSchemas", *DEFINITION_KEYS})  # name -> schema


def _rebased(node: Any, i: int, names: dict[tuple[str, str], str], named: bool = False) -> Any:
    """A copy of (part of) tools[i]'s parameters whose local "$ref"s point where `tools_json_schema` puts
    what they pointed to: "#/$defs/x/..." (or "#/definitions/x/...") to that definition's new name
    (`names`), any other "#..." into the parameters' own definition; values (`DATA_KEYS`) and a property
    named "$ref" or "enum" (a schema, under `NAME_MAPS`) are no keywords."""
    if isinstance(node, list):
        return [_rebased(x, i, names) for x in node]
    if not isinstance(node, dict):
        return node
    if named:  # {name: schema}: the names are no keywords
        return {k: _rebased(v, i, names) for k, v in node.items()}
    out: dict[str, Any] = {}
    for k, v in node.items():
        if k == "$ref" and isinstance(v, str) and (v == "#" or v.startswith("#/")):
            parts = v[2:].split("/", 2)
            name = parts[1].replace("~1", "/").replace("~0", "~") if len(parts) >= 2 else None  # (a JSON pointer)
            if parts[0] in DEFINITION_KEYS and (parts[0], name) in names:
                v = f"#/$defs/{names[parts[0], name]}" + ("/" + parts[2] if len(parts) > 2 else "")
            else:  # (a definition that is not there stays missing: the compiler names it)
                v = f"#/$defs/{_def_name(i)}" + v[1:]
            out[k] = v
        else:
            out[k] = v if k in DATA_KEYS else _rebased(v, i, names, k in NAME_MAPS)
    return out
