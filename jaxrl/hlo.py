"""A compiled program's costs from its optimized HLO text, loops counted as often as they run.

XLA's cost_analysis() counts the body of a while loop once, whatever its trip count, and a run's programs are loops
(the layer scan, microbatches, mini-batches, decode steps). Here every computation is weighted by how often it runs:
a while body by its trip count (XLA's known_trip_count where it says it, as XLA:CPU does; else the constant the
condition compares the counter with, as jax's scans and fori_loops count from 0, which is how XLA:TPU leaves them),
a fused or called computation as often as its caller. From that:

  flops: 2 x M x N x K of every dot and convolution (matmuls; elementwise work is left out);
  bytes: what every unfused op (and fusion) reads and writes in HBM, a slice or gather counted by what it takes and
    an in-place dynamic-update-slice or scatter by the update it writes (as XLA's own cost analysis counts them);
  collectives: the bytes of every all-gather (its output), all-reduce, reduce-scatter, all-to-all and
    collective-permute (their operands), by kind.

A Mosaic kernel (a Pallas TPU kernel: splash attention, paged decode) is a custom call whose inside the HLO does not
show: its operands and result count as bytes, its own FLOPs and traffic do not; `kernel_calls` says how many ran.

All per device (an SPMD program is one device's). `top` keeps the ops that move the most bytes and collectives, named
and FLOPs, named by the jax op that made them (their metadata), to say what a ratio above its target comes from.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re

_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4,
          "s64": 8, "u64": 8, "f64": 8, "s4": 0.5, "u4": 0.5, "c64": 8, "c128": 16}
_ARRAY = re.compile(r"\b([a-z]+[0-9]*(?:e[0-9]m[0-9]\w*)?)\[([0-9,]*)\]")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%(\S+) \(.*\{$")
_CALLS = re.compile(r"\b(calls|body|condition|to_apply|branch_computations|true_computation|false_computation)="
                    r"(\{[^}]*\}|%[\w.\-]+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
COLLECTIVES = {"all-gather": "all-gather", "all-gather-start": "all-gather", "all-reduce": "all-reduce",
               "all-reduce-start": "all-reduce", "reduce-scatter": "reduce-scatter", "all-to-all": "all-to-all",
               "ragged-all-to-all": "all-to-all", "collective-permute": "collective-permute",
               "collective-permute-start": "collective-permute"}
_FREE = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "while", "call", "conditional", "after-all",
         "partition-id", "replica-id", "opt-barrier", "async-start", "async-update", "async-done", "copy-done",
         "all-gather-done", "all-reduce-done", "collective-permute-done", "send-done", "recv-done"}


_SLICING = {"dynamic-slice", "gather", "slice"}  # read only what they take from operand 0
_IN_PLACE = {"dynamic-update-slice": 1, "scatter": 2}  # write operand 0 in place: only this operand's bytes move


def _dims(shape: str) -> list[tuple[str, list[int]]]:
  return [(t, [int(d) for d in ds.split(",") if d]) for t, ds in _ARRAY.findall(shape)]


def shape_bytes(shape: str) -> float:
  """Bytes of an HLO shape (a tuple's elements summed; layouts ignored)."""
  return sum(_BYTES.get(t, 1 if t.startswith("f8") else 4) * math.prod(ds) for t, ds in _dims(shape))


@dataclasses.dataclass
class Op:
  name: str
  shape: str
  opcode: str
  operands: list[str]
  args: str  # the text between the op's parentheses (a constant's value)
  attrs: str
  root: bool


def _split_instruction(line: str) -> Op | None:
  body = line.strip()
  root = body.startswith("ROOT ")
  body = body.removeprefix("ROOT ")
  if not body.startswith("%") or " = " not in body:
    return None
  name, rest = body[1:].split(" = ", 1)
  if rest.startswith("("):  # a tuple shape: up to its closing parenthesis
    end = _closing(rest, 1)
    shape, rest = rest[:end], rest[end + 1 :]
  else:
    shape, _, rest = rest.partition(" ")
  opcode, _, rest = rest.partition("(")
  end = _closing(rest, 0)
  args = rest[: end - 1]
  return Op(name, shape, opcode, re.findall(r"%([\w.\-]+)", args), args, rest[end:], root)


def _closing(text: str, start: int) -> int:
  """The index just past the parenthesis that closes one opened before text[start] (or at text[0] when start=1)."""
  depth, i = 1, start
  while depth and i < len(text):
    depth += (text[i] == "(") - (text[i] == ")")
    i += 1
  return i


def parse(text: str) -> tuple[dict[str, list[Op]], str]:
  """{computation: its ops} of an HLO module's text, and the entry computation's name.

  An instruction may span lines (a Mosaic kernel's backend_config holds its metadata's newlines, and a line of it
  may start with "}}"): lines that open no instruction continue the one before, and only a lone "}" closes a
  computation (closing at any "}" dropped the rest of a layer's ops after a splash call, and their FLOPs)."""
  computations, entry, current, pending = {}, None, None, []

  def flush():
    op = _split_instruction(" ".join(pending)) if pending else None
    if op is not None and current is not None:
      current.append(op)
    pending.clear()

  for line in text.splitlines():
    m = _COMPUTATION.match(line)
    if m:
      flush()
      current = computations.setdefault(m.group(1), [])
      entry = m.group(1) if line.startswith("ENTRY") else entry
    elif line.rstrip() == "}":
      flush()
      current = None
    elif current is not None:
      if line.lstrip().startswith(("%", "ROOT ")):
        flush()
      pending.append(line)
  flush()
  if entry is None:
    raise ValueError("no ENTRY computation in the HLO text")
  return computations, entry


def _callees(op: Op) -> list[tuple[str, str]]:
  return [(kind, name) for kind, names in _CALLS.findall(op.attrs) for name in re.findall(r"%([\w.\-]+)", names)]


@dataclasses.dataclass
class Costs:
  flops: float
  bytes: float
  collective_bytes: dict[str, float]
  unknown_loops: int  # while loops whose trip count is not a constant (counted once)
  kernel_calls: float  # runs of Mosaic kernels (tpu_custom_call): their own FLOPs and HBM traffic are not counted
  top_bytes: list[tuple[str, float]]  # (jax op, bytes) of the ops moving the most, summed by op name
  top_collectives: list[tuple[str, float]]
  top_flops: list[tuple[str, float]]

  @property
  def collectives(self) -> float:
    return sum(self.collective_bytes.values())


def _flops(op: Op, shapes: dict[str, str]) -> float:
  out = math.prod(d for _, ds in _dims(op.shape)[:1] for d in ds)
  if op.opcode == "dot":
    lhs = _dims(shapes.get(op.operands[0], ""))
    contract = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", op.attrs)
    if not lhs or not contract:
      return 0.0
    return 2.0 * out * math.prod(lhs[0][1][int(i)] for i in contract.group(1).split(",") if i)
  if op.opcode == "convolution":
    return _conv_flops(op, shapes)
  return 0.0


def _conv_flops(op: Op, shapes: dict[str, str]) -> float:
  """2 x the multiply-adds of a convolution: per output batch row and feature, the input features of its group times
  the window taps that land on the input (not on padding or dilation holes; XLA writes some batched matmuls as a
  convolution whose window slides over heads on padding)."""
  labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", op.attrs)
  lhs, rhs, out = _dims(shapes.get(op.operands[0], "")), _dims(shapes.get(op.operands[1], "")), _dims(op.shape)
  if not labels or not lhs or not rhs or not out:
    return 0.0
  lhs_l, rhs_l, out_l = labels.groups()
  size = lambda dims, ls, c: dims[0][1][ls.index(c)]  # noqa: E731
  window = _window(op.attrs, sum(ch.isdigit() for ch in lhs_l))
  taps = 1
  for k, (w, stride, lo, lhs_d, rhs_d) in enumerate(window):
    taps *= _taps(size(lhs, lhs_l, str(k)), w, size(out, out_l, str(k)), stride, lo, lhs_d, rhs_d)
  groups = re.search(r"feature_group_count=(\d+)", op.attrs)
  batch_groups = re.search(r"batch_group_count=(\d+)", op.attrs)
  inputs = size(lhs, lhs_l, "f") / (int(groups.group(1)) if groups else 1)
  rows = size(lhs, lhs_l, "b") / (int(batch_groups.group(1)) if batch_groups else 1)
  return 2.0 * rows * size(out, out_l, "f") * inputs * taps


def _window(attrs: str, rank: int) -> list[tuple[int, int, int, int, int]]:
  """(size, stride, low padding, lhs dilation, rhs dilation) of each spatial dimension."""
  m = re.search(r"window=\{([^}]*)\}", attrs)
  fields = dict(kv.split("=", 1) for kv in m.group(1).split()) if m else {}
  get = lambda key, default: [int(x.split("_")[0]) for x in fields[key].split("x")] if key in fields else \
      [default] * rank  # noqa: E731
  return list(zip(get("size", 1), get("stride", 1), get("pad", 0), get("lhs_dilate", 1), get("rhs_dilate", 1),
                  strict=True))


def _taps(n: int, w: int, m: int, stride: int, lo: int, lhs_d: int, rhs_d: int) -> int:
  """Window taps over m output positions that land on one of n input elements (dilated by lhs_d, low padding lo)."""
  extent = (n - 1) * lhs_d + 1
  if lhs_d == rhs_d == 1:
    return sum(max(0, min(w, extent - (j * stride - lo)) - max(0, lo - j * stride)) for j in range(m))
  return sum(1 for j in range(m) for t in range(w)
             if 0 <= (p := j * stride - lo + t * rhs_d) < extent and p % lhs_d == 0)


def costs(text: str, top: int = 8) -> Costs:
  """The program's per-device costs, each computation weighted by how often it runs (see the module doc)."""
  computations, entry = parse(text)
  shapes = {op.name: op.shape for ops in computations.values() for op in ops}
  runs, fused, unknown = _runs(computations, entry)
  flops = bytes_ = kernels = 0.0
  coll: dict[str, float] = collections.defaultdict(float)
  by_bytes: dict[str, float] = collections.defaultdict(float)
  by_coll: dict[str, float] = collections.defaultdict(float)
  by_flops: dict[str, float] = collections.defaultdict(float)
  for name, ops in computations.items():
    n = runs.get(name, 0.0)
    if not n:
      continue
    for op in ops:
      kernels += n * (op.opcode == "custom-call" and 'custom_call_target="tpu_custom_call"' in op.attrs)
      label = _label(op)
      work = n * _flops(op, shapes)
      flops += work
      by_flops[f"{op.opcode} {label}"] += work
      if op.opcode in COLLECTIVES:
        size = _collective_bytes(op, shapes)
        coll[COLLECTIVES[op.opcode]] += n * size
        by_coll[f"{COLLECTIVES[op.opcode]} {label}"] += n * size
      if name in fused or op.opcode in _FREE:
        continue
      moved = n * _moved(op, shapes, computations)
      bytes_ += moved
      by_bytes[f"{op.opcode} {label}"] += moved
  ranked = lambda d: sorted(((k, v) for k, v in d.items() if v), key=lambda kv: -kv[1])[:top]
  return Costs(flops, bytes_, dict(coll), unknown, kernels, ranked(by_bytes), ranked(by_coll), ranked(by_flops))


def _runs(computations: dict[str, list[Op]], entry: str) -> tuple[dict[str, float], set[str], int]:
  """How often each computation runs per execution of the entry (the sum over its call sites of the caller's count
  times the site's trip count), the fusion bodies, and the loops whose trip count is unknown (counted once)."""
  callers: dict[str, list[tuple[str, float]]] = collections.defaultdict(list)
  fused: set[str] = set()
  unknown = 0
  for name, ops in computations.items():
    for op in ops:
      called = _callees(op)
      for kind, callee in called:
        if kind == "to_apply":
          continue  # scalar reducers
        times = 1.0
        if op.opcode == "while" and kind == "body":
          known = re.search(r'"known_trip_count":\{"n":"([0-9]+)"', op.attrs)  # XLA:CPU/GPU say it; TPU does not
          trip = int(known.group(1)) if known else _loop_trip(computations, ops, op)
          unknown += trip is None
          times = float(trip or 1)
        if op.opcode == "fusion":
          fused.add(callee)
        callers[callee].append((name, times))
  runs: dict[str, float] = {entry: 1.0}

  def count(name: str) -> float:
    if name not in runs:
      runs[name] = 0.0  # a cycle (none in HLO) would stop here
      runs[name] = sum(count(caller) * times for caller, times in callers.get(name, []))
    return runs[name]

  for name in computations:
    count(name)
  return runs, fused, unknown


def _loop_trip(computations: dict[str, list[Op]], caller: list[Op], op: Op) -> int | None:
  """A while loop's trip count from its counter: the tuple element its condition compares with a constant limit
  (counter < limit, or limit > counter), its start in the loop's initial tuple (a constant, else 0) and its step in
  the body (counter + constant, else 1): jax's scans and XLA's own loops (a windowed einsum steps by 2)."""
  called = dict(_callees(op))
  condition, body = computations.get(called.get("condition"), []), computations.get(called.get("body"), [])
  constants = {o.name: int(o.args) for ops in (condition, body, caller) for o in ops
               if o.opcode == "constant" and re.fullmatch(r"-?[0-9]+", o.args)}
  by_name = {o.name: o for o in condition}
  root = next((o for o in condition if o.root), None)
  if root is None or root.opcode != "compare" or len(root.operands) != 2:
    return None
  direction = re.search(r"direction=(\w+)", root.attrs)
  counter, limit = root.operands if direction and direction.group(1) == "LT" else root.operands[::-1]
  if not direction or direction.group(1) not in ("LT", "GT") or limit not in constants:
    return None
  gte = by_name.get(counter)
  index = re.search(r"index=([0-9]+)", gte.attrs) if gte is not None and gte.opcode == "get-tuple-element" else None
  if index is None:
    return None
  k = int(index.group(1))
  start = _element_constant(caller, op.operands[0] if op.operands else "", k, constants)
  step = 1
  body_root = next((o for o in body if o.root), None)
  if body_root is not None and body_root.opcode == "tuple" and k < len(body_root.operands):
    update = {o.name: o for o in body}.get(body_root.operands[k])
    if update is not None and update.opcode == "add":
      step = next((constants[x] for x in update.operands if x in constants), 1)
  return max(0, -(-(constants[limit] - (start or 0)) // max(step, 1)))


def _element_constant(ops: list[Op], tuple_name: str, k: int, constants: dict[str, int]) -> int | None:
  """The constant value of element k of the tuple `tuple_name` (through copies), None if it is not one."""
  by_name = {o.name: o for o in ops}
  tup = by_name.get(tuple_name)
  if tup is None or tup.opcode != "tuple" or k >= len(tup.operands):
    return None
  name = tup.operands[k]
  while name in by_name and by_name[name].opcode == "copy":
    name = by_name[name].operands[0]
  return constants.get(name)


def _label(op: Op) -> str:
  m = _OP_NAME.search(op.attrs)
  return re.sub(r"^jit\([^)]*\)/", "", m.group(1)) if m else op.name


def _collective_bytes(op: Op, shapes: dict[str, str]) -> float:
  if COLLECTIVES[op.opcode] == "all-gather":  # the gathered result (a -start op's tuple: the largest element)
    return max((shape_bytes(f"{t}[{','.join(map(str, ds))}]") for t, ds in _dims(op.shape)), default=0.0)
  return sum(shape_bytes(shapes.get(o, "")) for o in op.operands)


def _moved(op: Op, shapes: dict[str, str], computations: dict[str, list[Op]]) -> float:
  """HBM bytes one execution of an unfused op reads and writes."""
  operands = [shape_bytes(shapes.get(o, "")) for o in op.operands]
  if op.opcode in _SLICING:
    return 2.0 * shape_bytes(op.shape) + sum(operands[1:])
  if op.opcode in _IN_PLACE:
    return 2.0 * operands[_IN_PLACE[op.opcode]] + sum(operands[1:])
  if op.opcode != "fusion":
    return sum(operands) + shape_bytes(op.shape)
  body = computations.get(dict(_callees(op)).get("calls", ""), [])
  total = sum(min(size, _read(body, i, computations)) for i, size in enumerate(operands))
  root = next((o for o in body if o.root), None)
  if root is not None and root.opcode in _IN_PLACE:  # in place: the update is what is written
    return total + shape_bytes(_shape_in(body, root.operands[_IN_PLACE[root.opcode]]))
  return total + shape_bytes(op.shape)


def _shape_in(body: list[Op], name: str) -> str:
  return next((o.shape for o in body if o.name == name), "")


def _read(body: list[Op], index: int, computations: dict[str, list[Op]]) -> float:
  """Bytes a fused computation reads of its parameter `index`: the slices it takes when it only slices it (a layer
  of stacked weights), nothing when it only updates it in place, else all of it (float("inf"): the caller's size)."""
  param = next((o.name for o in body if o.opcode == "parameter" and o.args.strip() == str(index)), None)
  return _read_value(body, param, computations) if param else float("inf")


def _read_value(body: list[Op], name: str, computations: dict[str, list[Op]]) -> float:
  if any(o.root and o.name == name for o in body):
    return float("inf")  # the fusion's result: read whole by whatever uses it
  total = 0.0
  for user in body:
    for k, operand in enumerate(user.operands):
      if operand != name:
        continue
      if user.opcode in _SLICING and k == 0:
        total += shape_bytes(user.shape)
      elif user.opcode in _IN_PLACE and k == 0:
        pass
      elif user.opcode in ("bitcast", "reshape"):
        total += _read_value(body, user.name, computations)
      elif user.opcode == "fusion":
        total += _read(computations.get(dict(_callees(user)).get("calls", ""), []), k, computations)
      else:
        return float("inf")
  return total
