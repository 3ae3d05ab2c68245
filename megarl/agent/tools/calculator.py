"""A calculator tool: arithmetic expressions evaluated safely (``ast``, no ``eval``).

Accepted: integers and decimals, ``+ - * / // % **``, unary ``+ -``, parentheses, and the
functions ``sqrt abs round floor ceil log exp sin cos tan min max`` plus ``pi`` and ``e``.
Anything else (names, attributes, calls of other functions, comprehensions, strings, ...) is
rejected before evaluation. Bounds keep a hostile expression cheap: at most ``max_length``
characters (default 500), exponents of at most ``max_exponent`` (1000) with a result of at most
``max_digits`` (1000) digits, so ``9**9**9`` is refused instead of running for hours.

Config (``config:`` in the tool YAML): ``max_length``, ``max_exponent``, ``max_digits``. The
schema's single parameter is ``expression`` (a string).
"""
from __future__ import annotations

import ast
import math
import operator
from typing import Any

from megarl.agent.tools.base import BaseTool, ToolResponse

DEFAULT_SCHEMA = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression, e.g. '12 * (3 + 4) / 5'.",
        "parameters": {"type": "object",
                       "properties": {"expression": {"type": "string", "description": "the expression"}},
                       "required": ["expression"]},
    },
}

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCTIONS = {"sqrt": math.sqrt, "abs": abs, "round": round, "floor": math.floor, "ceil": math.ceil, "log": math.log,
              "exp": math.exp, "sin": math.sin, "cos": math.cos, "tan": math.tan, "min": min, "max": max}
_CONSTANTS = {"pi": math.pi, "e": math.e}


class CalculatorError(ValueError):
    pass


class SafeCalculator:
    def __init__(self, max_length: int = 500, max_exponent: int = 1000, max_digits: int = 1000):
        self.max_length, self.max_exponent, self.max_digits = int(max_length), int(max_exponent), int(max_digits)

    def evaluate(self, expression: str) -> int | float:
        if not isinstance(expression, str) or not expression.strip():
            raise CalculatorError("the expression must be a non-empty string")
        if len(expression) > self.max_length:
            raise CalculatorError(f"the expression is longer than {self.max_length} characters")
        try:
            tree = ast.parse(expression.strip(), mode="eval")
        except SyntaxError as exc:
            raise CalculatorError(f"cannot parse {expression!r}: {exc.msg}") from None
        return self._eval(tree.body)

    def _eval(self, node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.Name) and node.id in _CONSTANTS:
            return _CONSTANTS[node.id]
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return self._check(_UNARY[type(node.op)](self._eval(node.operand)))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = self._eval(node.left), self._eval(node.right)
            if isinstance(node.op, ast.Pow):
                self._check_power(left, right)
            try:
                return self._check(_BINARY[type(node.op)](left, right))
            except ZeroDivisionError:
                raise CalculatorError("division by zero") from None
            except OverflowError:
                raise CalculatorError("the result is too large") from None
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS
                and not node.keywords and node.args):
            args = [self._eval(a) for a in node.args]
            try:
                return self._check(_FUNCTIONS[node.func.id](*args))
            except (ValueError, OverflowError, TypeError) as exc:
                raise CalculatorError(f"{node.func.id}: {exc}") from None
        raise CalculatorError(f"unsupported syntax: {ast.dump(node)[:80]} (numbers, + - * / // % **, "
                              f"parentheses and {', '.join(_FUNCTIONS)} only)")

    def _check_power(self, base: Any, exponent: Any) -> None:
        if abs(exponent) > self.max_exponent:
            raise CalculatorError(f"exponent {exponent} is larger than {self.max_exponent}")
        if isinstance(base, int) and isinstance(exponent, int) and base not in (0, 1, -1) and exponent > 0:
            if exponent * math.log10(abs(base)) > self.max_digits:
                raise CalculatorError(f"the result would have more than {self.max_digits} digits")

    def _check(self, value: Any) -> int | float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise CalculatorError(f"unsupported value {value!r}")
        if isinstance(value, float) and not math.isfinite(value):
            raise CalculatorError("the result is not a finite number")
        if isinstance(value, int) and value.bit_length() > self.max_digits * 3.33:
            raise CalculatorError(f"the result has more than {self.max_digits} digits")
        return value


def format_number(value: int | float) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(value) if isinstance(value, float) else str(value)


class CalculatorTool(BaseTool):
    def __init__(self, config: dict[str, Any] | None = None, tool_schema: dict[str, Any] | None = None):
        super().__init__(config, tool_schema or DEFAULT_SCHEMA)
        unknown = sorted(set(self.config) - {"type", "max_length", "max_exponent", "max_digits"})
        if unknown:
            raise ValueError(f"calculator tool: unknown config keys {unknown} (known: max_length, max_exponent, max_digits)")
        self.calculator = SafeCalculator(**{k: v for k, v in self.config.items() if k != "type"})
        properties = self.tool_schema["function"]["parameters"].get("properties", {})
        self.argument = next(iter(properties), "expression")

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> tuple[ToolResponse, float, dict]:
        expression = parameters.get(self.argument)
        try:
            value = self.calculator.evaluate(expression)
        except CalculatorError as exc:
            return ToolResponse(text=f"Error: {exc}"), 0.0, {"calculator_error": 1}
        return ToolResponse(text=format_number(value)), 0.0, {}
