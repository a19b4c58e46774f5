"""Generated parts of docs/operations.md: the configuration table and the metric catalogue.

Imports: stdlib + sidecar.config + sidecar.metrics.registry. `python -m sidecar.docgen` rewrites
the marked sections in place; a test fails when the doc and the code disagree.
"""

from __future__ import annotations

import re
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any, get_args

from sidecar.config import env_name, field_paths
from sidecar.metrics.registry import METRICS

DOC = Path(__file__).resolve().parent.parent / "docs" / "operations.md"


def _type_name(t: Any) -> str:
    args = get_args(t)
    if args and hasattr(args[0], "__name__") and str(t).startswith("typing.Annotated"):
        return str(args[0].__name__)
    if str(t).startswith("typing.Literal"):
        return " \\| ".join(str(a) for a in args)
    if isinstance(t, types.UnionType):  # bool | None: unset means "infer"
        return " \\| ".join("unset" if a is type(None) else a.__name__ for a in args)
    return getattr(t, "__name__", str(t))


# Fields whose type alone does not say what they take.
TYPE_NOTES = {"manager.endpoint": "str: one URL, or seed URLs separated by commas"}


def config_table() -> str:
    rows = ["| field | env | type | default |", "|---|---|---|---|"]
    for path, typ, default in field_paths():
        shown = "(empty)" if default == "" else default
        kind = TYPE_NOTES.get(path) or _type_name(typ)
        rows.append(f"| `{path}` | `{env_name(path)}` | {kind} | `{shown}` |")
    return "\n".join(rows)


def metrics_table() -> str:
    rows = ["| metric | type | meaning |", "|---|---|---|"]
    for name, (kind, text) in METRICS.items():
        shown = f"{name}_total" if kind == "counter" else name
        rows.append(f"| `{shown}` | {kind} | {text} |")
    return "\n".join(rows)


SECTIONS = {"config-table": config_table, "metrics-table": metrics_table}


def _replacer(body: str) -> Callable[[re.Match[str]], str]:
    return lambda m: m.group(1) + body + "\n" + m.group(2)


def render(doc: str) -> str:
    for tag, fn in SECTIONS.items():
        pattern = re.compile(
            rf"(<!-- generated:{tag} -->\n)(?:.*?\n)?(<!-- end:{tag} -->)", flags=re.DOTALL
        )
        doc = pattern.sub(_replacer(fn()), doc)
    return doc


def main() -> None:
    text = DOC.read_text()
    new = render(text)
    if new != text:
        DOC.write_text(new)
        sys.stdout.write(f"updated {DOC}\n")


if __name__ == "__main__":
    main()
