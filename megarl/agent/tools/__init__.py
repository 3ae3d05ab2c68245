"""verl's tool interface (``BaseTool``), the tool YAML and function tools (``config``), the rules
for running a call (``toolset``), and megarl's built-in tools: ``calculator``, ``answer_check``
(verl's GSM8K and Geo3k tools) and ``python_code`` (sandboxed, ``sandbox``)."""
from megarl.agent.tools.base import BaseTool, ToolResponse
from megarl.agent.tools.config import BUILTIN_TOOLS, VERL_CLASS_NAMES, load_function_tools, load_tool_config
from megarl.agent.tools.toolset import CallOutcome, ToolSet

__all__ = ["BUILTIN_TOOLS", "BaseTool", "CallOutcome", "ToolResponse", "ToolSet", "VERL_CLASS_NAMES",
           "load_function_tools", "load_tool_config"]
