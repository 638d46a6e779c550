"""A calculator tool: evaluates one arithmetic expression (+ - * / // % **, parentheses, numbers).

A small model writes `57 * 3` more reliably than a Python program that prints it, and the answer is
one number rather than a program's output, so this is the tool of the multi-step task's traces
(`fulcrum.agent.multistep_tools`). The expression is parsed with `ast` and walked node by node: names,
calls, attributes and every other node are refused, so nothing but arithmetic runs and no sandbox
process is needed. Powers and results are bounded so that `9 ** 9 ** 9` is refused rather than
computed. A whole-number result is written without a decimal point (`57`, not `57.0`), as the
task's worked solutions write it.

Config keys: `max_abs_value` (results and operands beyond it are refused, default 1e12),
`max_expression_chars` (default 200).
"""

from __future__ import annotations

import ast
from typing import Any

from fulcrum.agent.metrics import error_key
from fulcrum.agent.schema import OpenAIFunctionToolSchema, ToolConfigError, ToolResponse
from fulcrum.agent.tool import BaseTool
from fulcrum.reward.safe_eval import BINARY_OPERATORS, UNARY_OPERATORS

CONFIG_KEYS = {"type": "native", "max_abs_value": 1e12, "max_expression_chars": 200}

_DEFAULT_SCHEMA = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with + - * / and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {
                "expression": {"type": "string", "description": "The expression, e.g. (12 + 7) * 3"}
            },
            "required": ["expression"],
        },
    },
}

_MAX_EXPONENT = 64  # 2 ** 64 is already past max_abs_value's default; bigger exponents are refused


class CalculatorError(ValueError):
    """An expression the calculator does not evaluate; the message is what the model reads."""


def evaluate(expression: str, max_abs_value: float = 1e12) -> int | float:
    """The value of an arithmetic expression; CalculatorError for anything else (names, calls, strings),
    division by zero, or a value (or an intermediate one) beyond `max_abs_value`."""
    text = expression.strip().replace("×", "*").replace("÷", "/").replace("−", "-")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as err:
        raise CalculatorError(f"not an arithmetic expression: {expression!r}") from err
    return _value(tree.body, max_abs_value)


def _value(node: ast.AST, limit: float) -> int | float:
    """One node's value, refusing every node that is not a number or an arithmetic operator."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        result = node.value
    elif isinstance(node, ast.BinOp) and type(node.op) in BINARY_OPERATORS:
        left, right = _value(node.left, limit), _value(node.right, limit)
        if isinstance(node.op, ast.Pow) and abs(right) > _MAX_EXPONENT:
            raise CalculatorError(f"exponent {right} is too large")
        try:
            result = BINARY_OPERATORS[type(node.op)](left, right)
        except ZeroDivisionError as err:
            raise CalculatorError("division by zero") from err
    elif isinstance(node, ast.UnaryOp) and type(node.op) in UNARY_OPERATORS:
        result = UNARY_OPERATORS[type(node.op)](_value(node.operand, limit))
    else:
        raise CalculatorError(f"only numbers and + - * / ( ) are allowed, not {type(node).__name__}")
    if isinstance(result, complex) or abs(result) > limit:
        raise CalculatorError(f"the value is out of range (|x| > {limit:g})")
    return result


def format_number(value: int | float) -> str:
    """`57` for 57 and 57.0, else the float rounded to 10 significant digits (`0.3333333333`)."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value) if isinstance(value, int) else f"{value:.10g}"


class CalculatorTool(BaseTool):
    """`calculator(expression)`: the value of an arithmetic expression, or an error line the model reads."""

    def __init__(self, config: dict[str, Any], tool_schema: OpenAIFunctionToolSchema | None) -> None:
        super().__init__(config, tool_schema)
        unknown = sorted(set(self.config) - set(CONFIG_KEYS))
        if unknown:
            raise ToolConfigError(
                f"config: unknown key(s) {', '.join(unknown)}; known: {', '.join(CONFIG_KEYS)}"
            )
        self.max_abs_value = float(self.config.get("max_abs_value", CONFIG_KEYS["max_abs_value"]))
        self.max_chars = int(self.config.get("max_expression_chars", CONFIG_KEYS["max_expression_chars"]))

    @classmethod
    def default_tool_schema(cls) -> OpenAIFunctionToolSchema:
        """`calculator(expression: string)`."""
        return OpenAIFunctionToolSchema.from_dict(_DEFAULT_SCHEMA, "CalculatorTool default schema")

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float | None, dict[str, float]]:
        """The expression's value as text; a refused expression is an `invalid_expression` error."""
        expression = parameters.get("expression", "")
        if not isinstance(expression, (str, int, float)) or isinstance(expression, bool):
            return _refused(f"expression must be text, got {type(expression).__name__}")
        expression = str(expression)
        if len(expression) > self.max_chars:
            return _refused(f"expression longer than {self.max_chars} characters")
        try:
            return ToolResponse(text=format_number(evaluate(expression, self.max_abs_value))), None, {}
        except CalculatorError as err:
            return _refused(str(err))


def _refused(reason: str) -> tuple[ToolResponse, None, dict[str, float]]:
    """The answer to an expression the calculator does not evaluate."""
    return ToolResponse(text=f"Error: {reason}"), None, {error_key("invalid_expression"): 1.0}
