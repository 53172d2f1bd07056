"""Final-answer extraction from free text, and exact comparison of numeric answers."""

from __future__ import annotations

import re
from fractions import Fraction

# A number not glued to a word or a decimal point; "-" is a sign only where it cannot be a minus ("10-3" is 10, 3).
# Thousands separators must be well formed ("1,234,567"); "1,2,3" is three numbers.
NUMBER = re.compile(r"(?<![\w.])(?:(?<![\w)\]])-)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?!\d)")
_MINUS = str.maketrans({"−": "-", "–": "-"})
_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_HASHES = re.compile(r"####\s*([^\n]*)")
_ANSWER_IS = re.compile(r"answer\s*(?:is|:|=)\s*:?([^\n]*)", re.IGNORECASE)


def numbers(text: str) -> list[str]:
  """Every number in `text`, in order, without thousands separators."""
  return [m.group().replace(",", "") for m in NUMBER.finditer(text.translate(_MINUS))]


def parse_number(text: str) -> Fraction | None:
  """The exact value of a number written alone ("1,234", "-3.50", "$12", "42."), else None."""
  s = text.translate(_MINUS).strip().removeprefix("$").rstrip(".").strip()
  found = numbers(s)
  if len(found) != 1 or NUMBER.fullmatch(s) is None:
    return None
  return Fraction(found[0])


def _boxed(text: str) -> list[str]:
  """Contents of every \\boxed{...}, braces balanced."""
  out, start = [], 0
  while (i := text.find("\\boxed{", start)) >= 0:
    depth, j = 1, i + len("\\boxed{")
    while j < len(text) and depth:
      depth += {"{": 1, "}": -1}.get(text[j], 0)
      j += 1
    if depth:
      break
    out.append(text[i + len("\\boxed{") : j - 1])
    start = j
  return out


def explicit_answer(text: str) -> str | None:
  """The answer a completion states explicitly: the last <answer>..</answer>, \\boxed{..}, "#### x" or
  "answer: x" / "answer is x" (in that order of preference); a number inside it is preferred to the raw text."""
  for contents, pick in ((_TAG.findall(text), -1), (_boxed(text), -1), (_HASHES.findall(text), 0),
                         (_ANSWER_IS.findall(text), 0)):
    if contents:
      body = contents[-1]
      found = numbers(body)
      if found:
        return found[pick]
      if body.strip() and pick == -1:  # a tag or box holding a non-number ("\boxed{x+1}")
        return body.strip()
  return None


def extract_answer(text: str) -> str | None:
  """The explicit answer if there is one, else the last number in the text, else None."""
  found = explicit_answer(text)
  if found is not None:
    return found
  nums = numbers(text)
  return nums[-1] if nums else None


def answers_match(predicted: str | None, reference: str) -> bool:
  """Numbers compare by exact value ("1,234.0" == "1234"); anything else by case-folded text."""
  if predicted is None:
    return False
  p, r = parse_number(predicted), parse_number(reference)
  if p is not None and r is not None:
    return p == r
  return predicted.strip().casefold() == reference.strip().casefold()
