"""Arithmetic on literals, where verl's math grader calls Python's `eval` on model-written text.

`arith_eval("2*3.14159")` evaluates numbers, `+ - * / // % **`, unary signs, parentheses, tuples and
lists, which is everything `eval` gives a value for in the grader's inputs (answers with `\\pi`
replaced by a number, matrices written as nested lists). Anything else (a name, a call, an attribute,
a string) raises UnsafeExpression, where `eval` would have run it: model-written code never runs here.
Powers with an exponent above MAX_EXPONENT are refused too (`9**9**9` would never finish).
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable
from typing import Any

MAX_EXPONENT = 10_000

BINARY_OPERATORS: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
UNARY_OPERATORS: dict[type[ast.unaryop], Callable[[Any], Any]] = {
    ast.UAdd: operator.pos,
    ast.USub: operator.neg,
}


class UnsafeExpression(ValueError):
    """The text is not arithmetic on literals (or does not parse)."""


def _value(node: ast.AST) -> Any:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float, complex):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in UNARY_OPERATORS:
        return UNARY_OPERATORS[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in BINARY_OPERATORS:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and isinstance(right, (int, float)) and abs(right) > MAX_EXPONENT:
            raise UnsafeExpression(f"exponent {right} is above {MAX_EXPONENT}")
        return BINARY_OPERATORS[type(node.op)](left, right)
    if isinstance(node, ast.Tuple):
        return tuple(_value(e) for e in node.elts)
    if isinstance(node, ast.List):
        return [_value(e) for e in node.elts]
    raise UnsafeExpression(f"not arithmetic: {type(node).__name__}")


def arith_eval(text: str) -> Any:
    """The value of `text` as arithmetic on literals; UnsafeExpression (or ZeroDivisionError,
    OverflowError) where it is not one or does not evaluate."""
    try:
        tree = ast.parse(text.lstrip(" \t"), mode="eval")
    except (SyntaxError, ValueError) as err:
        raise UnsafeExpression(str(err)) from None
    return _value(tree.body)
