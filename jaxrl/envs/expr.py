"""Exact evaluation of untrusted arithmetic text: integers, + - * /, parentheses. An AST walker, never eval."""

from __future__ import annotations

import ast
import operator
from fractions import Fraction

MAX_EXPR_CHARS = 256  # longer text is rejected before parsing (deep nesting can exhaust the parser)

_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_SYMBOLS = str.maketrans({"×": "*", "·": "*", "÷": "/", "−": "-", "–": "-"})


class ExprError(ValueError):
  """Text that is not a plain arithmetic expression, or one that cannot be evaluated (division by zero)."""


def parse(text: str) -> ast.expr:
  """Parses `text` and checks that it only holds integer literals, + - * / and parentheses."""
  text = text.translate(_SYMBOLS).strip()
  if not text:
    raise ExprError("empty expression")
  if len(text) > MAX_EXPR_CHARS:
    raise ExprError(f"expression longer than {MAX_EXPR_CHARS} characters")
  try:
    tree = ast.parse(text, mode="eval").body
  except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
    raise ExprError(f"not an expression: {type(e).__name__}") from None
  for node in ast.walk(tree):
    if isinstance(node, ast.BinOp):
      if type(node.op) not in _BINOPS:
        raise ExprError(f"operator {type(node.op).__name__} is not allowed (only + - * /)")
    elif isinstance(node, ast.Constant):
      if type(node.value) is not int:
        raise ExprError(f"literal {node.value!r} is not an integer")
    elif not isinstance(node, ast.operator):
      raise ExprError(f"{type(node).__name__} is not allowed (only integers, + - * / and parentheses)")
  return tree


def literals(tree: ast.expr) -> list[int]:
  """The integer literals of a parsed expression, in reading order."""
  nodes = [n for n in ast.walk(tree) if isinstance(n, ast.Constant)]
  return [n.value for n in sorted(nodes, key=lambda n: n.col_offset)]


def evaluate(tree: ast.expr) -> Fraction:
  """Exact value of a tree returned by `parse`."""
  if isinstance(tree, ast.Constant):
    return Fraction(tree.value)
  left, right = evaluate(tree.left), evaluate(tree.right)
  if isinstance(tree.op, ast.Div) and right == 0:
    raise ExprError("division by zero")
  return _BINOPS[type(tree.op)](left, right)


def value(text: str) -> Fraction:
  return evaluate(parse(text))
