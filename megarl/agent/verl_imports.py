"""What a file copied from verl imports from verl, and megarl's replacement for each.

A tool or agent loop copied from verl (its ``Gsm8kTool``, say) starts with verl imports; megarl
does not install verl, so loading the file fails with ``No module named 'verl'``. The loader
(``megarl.agent.loop.load_module``) turns that into an error listing these replacements.
"""
from __future__ import annotations

VERL_IMPORTS = (  # (what the verl file imports, what megarl offers instead)
    ("from verl.tools.base_tool import BaseTool", "from megarl.agent.tools import BaseTool"),
    ("from verl.tools.schemas import ToolResponse", "from megarl.agent.tools import ToolResponse"),
    ("from verl.tools.schemas import OpenAIFunctionToolSchema",
     "no import: megarl's tool_schema is the OpenAI schema as a plain dict (annotate it as dict)"),
    ("from verl.utils.reward_score import gsm8k", "from megarl.rewards import gsm8k (the same compute_score arguments)"),
    ("from verl.utils.rollout_trace import rollout_trace_op",
     "no import: megarl has no rollout tracing; delete the @rollout_trace_op decorator"),
)


def verl_import_problem(exc: ImportError, where: str) -> str | None:
    """The message for ``exc`` when it is a missing verl module, else None."""
    name = getattr(exc, "name", None) or ""
    if name != "verl" and not name.startswith("verl."):
        return None
    replacements = "; ".join(f"`{verl}` -> {megarl}" for verl, megarl in VERL_IMPORTS)
    return (f"{where} imports {name!r} (No module named {name!r}): megarl does not install verl. Replace verl's "
            f"imports with megarl's: {replacements}")
