"""Device-memory traffic of a compiled XLA program, read from its optimized HLO text: a
static profile of what each instruction reads and writes, per iteration of each loop.

Each top-level instruction of a computation (a fusion, a library matmul, a copy, …) is
one kernel that reads its operands from device memory and writes its result there; what
happens inside a fusion stays in registers. Two kinds of fusion touch only part of an
operand and are counted at that size:

- a fusion that only slices an operand (`dynamic-slice`, `slice`, `gather`, possibly
  through bitcasts) reads the slices, not the operand;
- a fusion whose root is a `dynamic-update-slice` or a `scatter` into one of its
  operands updates that buffer in place (XLA aliases them): it writes the update, not
  the whole buffer.

A kernel outside XLA's fusions (a custom call: a Pallas kernel, a library call) whose
output aliases one of its operands (`output_to_operand_aliasing`) updates that buffer in
place, as the decode step's attention-input kernel writes the new keys and values into
the KV cache; how much of it the kernel touches is not in the program, so the aliased
buffer is counted neither read nor written (the kernel's other operands and outputs
are).

`while` loops are expanded into a tree: a loop's traffic per iteration is its body's
instructions plus each nested loop's per-iteration traffic times that loop's known trip
count. A decode loop (stopped when every row has ended) has no known trip count, so its
figure is the bytes of one decode step. A `call` (newer XLA wraps a CPU while loop in
one; a GPU command buffer is one) counts as the instructions and loops of the
computation it calls.

This is what the compiler's program moves, not what the hardware achieves: comparing it
with `roofline.decode_step_bytes` says how much of the gap to the memory roofline is
extra traffic, and the rest is time lost to small kernels, launches and latency.

`memory_plan` reads what a compiled program needs on its device from XLA's own plan.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Iterator

# Bytes per element of HLO's array types (pred is stored as a byte).
ELEMENT_BYTES = {
    "pred": 1,
    "s4": 1,
    "u4": 1,
    "s8": 1,
    "u8": 1,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
}
_ARRAY = re.compile(r"\b(" + "|".join(ELEMENT_BYTES) + r")\[([\d,]*)\]")
_COMPUTATION = re.compile(r"^(ENTRY )?%?([\w.\-]+) \(.*\) -> .* \{$")
_INSTRUCTION = re.compile(r"^\s*(ROOT )?%([\w.\-]+) = (.*)$")
# Instructions that move no data of their own: tuple plumbing, aliases, constants.
_FREE = frozenset(
    {"parameter", "get-tuple-element", "tuple", "constant", "bitcast", "after-all", "iota"}
)
_SLICES = frozenset({"dynamic-slice", "slice", "gather"})
# Ops that write into their first operand's buffer in place (XLA aliases it with the
# result), and which operand holds what they write.
_UPDATE_OPERAND = {"dynamic-update-slice": 1, "scatter": 2}
# Elementwise opcodes: an element of the result needs only the same element of operands.
_ELEMENTWISE = frozenset(
    {
        "abs", "add", "and", "atan2", "bitcast-convert", "cbrt", "ceil", "clamp", "compare",
        "convert", "cosine", "divide", "exponential", "exponential-minus-one", "floor",
        "is-finite", "log", "log-plus-one", "logistic", "maximum", "minimum", "multiply",
        "negate", "not", "or", "popcnt", "power", "remainder", "round-nearest-afz",
        "round-nearest-even", "rsqrt", "select", "shift-left", "shift-right-arithmetic",
        "shift-right-logical", "sign", "sine", "sqrt", "subtract", "tan", "tanh", "xor",
    }
)  # fmt: skip
# What a kernel does, as `Access.kind` names it.
CATEGORIES = (
    "matmul",  # a library or Triton matmul, with whatever XLA fused into it
    "reduction",  # a reduce (max, sum, argmax, norms) with its fused producers
    "update in place",  # writes a slice into a buffer it aliases (a KV cache write)
    "slice copy",  # copies a slice out of a larger buffer (a layer out of a stack)
    "elementwise",  # a loop fusion: converts, adds, multiplies, concatenations
    "copy",  # a layout change or a buffer copy
    "other",
)


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One HLO instruction: `name = shape opcode(operands), attributes`."""

    name: str
    shape: str
    opcode: str
    operands: tuple[str, ...]
    attributes: str
    is_root: bool


@dataclasses.dataclass(frozen=True)
class Access:
    """A top-level instruction's device-memory traffic, in bytes, per execution."""

    name: str
    kind: str  # what the kernel does: one of CATEGORIES
    read_bytes: int
    written_bytes: int
    shape: str
    flops: int = 0  # of its matmuls (2 per multiply-add); elementwise work is not counted
    kernel: str = ""  # a custom call's kernel name (a Pallas kernel's `name`), else empty
    operand_read_bytes: tuple[int, ...] = ()  # a custom call's: what it reads of each operand

    @property
    def bytes(self) -> int:
        return self.read_bytes + self.written_bytes

    def seconds_at_least(self, bytes_per_s: float, flops_per_s: float) -> float:
        """The kernel's roofline time: its bytes at full bandwidth or its matmul FLOPs at
        the dense peak, whichever is longer."""
        return max(self.bytes / bytes_per_s, self.flops / flops_per_s)


@dataclasses.dataclass(frozen=True)
class Loop:
    """A while loop: its body's accesses and nested loops; trip_count None if unknown."""

    name: str
    trip_count: int | None
    accesses: tuple[Access, ...]
    loops: tuple[Loop, ...]

    def bytes_per_iteration(self) -> int:
        """Bytes one iteration moves: its own instructions, and nested loops times their
        known trip counts (once, if unknown)."""
        return sum(access.bytes * times for access, times in self.all_accesses())

    def flops_per_iteration(self) -> int:
        return sum(access.flops * times for access, times in self.all_accesses())

    def seconds_at_least(self, bytes_per_s: float, flops_per_s: float) -> float:
        """One iteration's roofline time: every kernel at its own bound, one after another."""
        return sum(
            access.seconds_at_least(bytes_per_s, flops_per_s) * times
            for access, times in self.all_accesses()
        )

    def kernels_per_iteration(self) -> int:
        return sum(times for _, times in self.all_accesses())

    def all_accesses(self) -> Iterator[tuple[Access, int]]:
        """(access, executions per iteration of this loop), nested loops included."""
        for access in self.accesses:
            yield access, 1
        for loop in self.loops:
            for access, times in loop.all_accesses():
                yield access, times * (loop.trip_count or 1)


@dataclasses.dataclass(frozen=True)
class Module:
    computations: dict[str, tuple[Instruction, ...]]
    entry: str


def _arrays(shape: str) -> Iterator[tuple[str, int]]:
    """(element type, element count) of every array in an HLO shape; layouts ignored."""
    for element, dims in _ARRAY.findall(shape):
        yield element, math.prod(int(d) for d in dims.split(",") if d)


def array_elements(shape: str) -> int:
    """Elements of every array in an HLO shape (a tuple's elements summed)."""
    return sum(count for _, count in _arrays(shape))


def array_bytes(shape: str) -> int:
    """Bytes of every array in an HLO shape (a tuple's elements summed)."""
    return sum(ELEMENT_BYTES[element] * count for element, count in _arrays(shape))


def _balanced_end(text: str, start: int) -> int:
    """Index of the bracket closing the one opened at text[start]."""
    depth = 0
    for index in range(start, len(text)):
        if text[index] in "([{":
            depth += 1
        elif text[index] in ")]}":
            depth -= 1
            if depth == 0:
                return index
    raise ValueError(f"unbalanced brackets in HLO: {text[start : start + 80]!r}")


def _split_top_level(text: str) -> list[str]:
    """Splits at the commas that are outside every bracket."""
    parts, depth, current = [], 0, []
    for char in text:
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        if char == "," and depth == 0:
            parts.append("".join(current).strip())
            current = []
        else:
            current.append(char)
    if "".join(current).strip():
        parts.append("".join(current).strip())
    return parts


def parse_instruction(line: str) -> Instruction | None:
    match = _INSTRUCTION.match(line)
    if not match:
        return None
    is_root, name, rest = bool(match.group(1)), match.group(2), match.group(3)
    if rest.startswith("("):  # a tuple shape
        end = _balanced_end(rest, 0)
        shape, rest = rest[: end + 1], rest[end + 1 :].lstrip()
    else:
        shape, rest = rest.split(" ", 1)
    opcode = re.match(r"([a-z][\w\-]*)\(", rest)
    if opcode is None:
        return None
    open_at = opcode.end() - 1
    close_at = _balanced_end(rest, open_at)
    listed = re.sub(r"/\*.*?\*/", "", rest[open_at + 1 : close_at])  # /*index=5*/ marks
    operands = tuple(part.split()[-1].lstrip("%") for part in _split_top_level(listed))
    return Instruction(name, shape, opcode.group(1), operands, rest[close_at + 1 :], is_root)


def parse_module(text: str) -> Module:
    """The computations of an optimized HLO module (`compiled.as_text()`)."""
    computations: dict[str, list[Instruction]] = {}
    entry, current = None, None
    for line in text.splitlines():
        header = _COMPUTATION.match(line)
        if header:
            current = header.group(2)
            computations[current] = []
            if header.group(1):
                entry = current
        elif line.startswith("}"):
            current = None
        elif current is not None:
            instruction = parse_instruction(line)
            if instruction is not None:
                computations[current].append(instruction)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text: pass compiled.as_text()")
    return Module({name: tuple(body) for name, body in computations.items()}, entry)


def _dims(text: str | None) -> list[int]:
    return [int(d) for d in re.findall(r"\d+", text or "")]


def dot_flops(instruction: Instruction, shapes: dict[str, str]) -> int:
    """2 × output elements × contracted size of a `dot`, or of a library matmul call
    (cuBLAS's custom call names the contracting dims in its backend config)."""
    contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", instruction.attributes)
    if contracting is None:
        contracting = re.search(
            r'"lhs_contracting_dimensions":\[([^\]]*)\]', instruction.attributes
        )
    if contracting is None or not instruction.operands:
        return 0
    lhs = _ARRAY.search(shapes.get(instruction.operands[0], ""))
    if lhs is None:
        return 0
    lhs_dims = _dims(lhs.group(2))
    contracted = math.prod(lhs_dims[d] for d in _dims(contracting.group(1)))
    output = _ARRAY.search(instruction.shape)  # a library call's first output is the product
    return 2 * array_elements(output.group(0)) * contracted if output else 0


def _attribute(instruction: Instruction, key: str) -> str | None:
    match = re.search(key + r"=%?([\w.\-]+)", instruction.attributes)
    return match.group(1) if match else None


def _trip_count(instruction: Instruction) -> int | None:
    match = re.search(r'"known_trip_count":\{"n":"(\d+)"', instruction.attributes)
    return int(match.group(1)) if match else None


class _FusionBody:
    """A fused computation, to count what its parameters and root really touch."""

    def __init__(self, body: tuple[Instruction, ...]):
        self.by_name = {instruction.name: instruction for instruction in body}
        self.parameters = {
            instruction.name: int(instruction.operands[0])
            for instruction in body
            if instruction.opcode == "parameter"
        }
        self.users: dict[str, list[Instruction]] = {name: [] for name in self.by_name}
        for instruction in body:
            for operand in instruction.operands:
                self.users.setdefault(operand, []).append(instruction)
        self.root = next(instruction for instruction in body if instruction.is_root)
        self.output_names = {output.name for output in self.outputs()}

    def through_bitcasts(self, name: str) -> str:
        while name in self.by_name and self.by_name[name].opcode == "bitcast":
            name = self.by_name[name].operands[0]
        return name

    def sliced_elements(self, name: str) -> int | None:
        """Elements read of `name` if every use reads only slices of it, else None. A
        slice may be taken of the value itself, of a bitcast, of an in-place update, or of
        elementwise results computed from it (XLA computes those only where sliced)."""
        if name in self.output_names:  # written out whole
            return None
        total = 0
        for user in self.users.get(name, []):
            if user.opcode in _ELEMENTWISE or user.opcode == "bitcast":
                part = self.sliced_elements(user.name)
            elif user.opcode in _UPDATE_OPERAND and user.operands[0] == name:
                part = 0 if user.is_root else self.sliced_elements(user.name)
            elif user.opcode in _SLICES and user.operands[0] == name:
                part = array_elements(user.shape)
            elif user.opcode == "tuple":
                part = 0
            else:
                return None
            if part is None:
                return None
            total += part
        return total

    def matmul_flops(self) -> int:
        shapes = {name: instruction.shape for name, instruction in self.by_name.items()}
        return sum(
            dot_flops(instruction, shapes)
            for instruction in self.by_name.values()
            if instruction.opcode == "dot"
        )

    def outputs(self) -> list[Instruction]:
        if self.root.opcode == "tuple":
            return [self.by_name[name] for name in self.root.operands]
        return [self.root]


def _fusion_traffic(body: _FusionBody, operand_shapes: list[str]) -> tuple[int, int]:
    """(read, written) bytes of one fusion over operands of these shapes."""
    written, updated_in_place = 0, set()
    for output in body.outputs():
        if output.opcode in _UPDATE_OPERAND:
            update = output.operands[_UPDATE_OPERAND[output.opcode]]
            written += array_bytes(body.by_name[update].shape)
            updated_in_place.add(body.through_bitcasts(output.operands[0]))
        else:
            written += array_bytes(output.shape)
    read = 0
    for parameter, index in body.parameters.items():
        if parameter in updated_in_place or index >= len(operand_shapes):
            continue
        whole = array_bytes(operand_shapes[index])
        sliced = body.sliced_elements(parameter)
        if sliced is None:
            read += whole
        else:
            elements = array_elements(operand_shapes[index])
            read += whole * min(sliced, elements) // max(elements, 1)
    return read, written


def _fusion_category(body: _FusionBody, fusion_kind: str | None, called: str) -> str:
    roots = {output.opcode for output in body.outputs()}
    if "gemm" in called or "dot" in roots or "convolution" in roots:
        return "matmul"
    if roots <= set(_UPDATE_OPERAND):
        return "update in place"
    if fusion_kind == "kInput" or "reduce" in roots:
        return "reduction"
    if roots <= _SLICES | {"copy"} and any(
        body.sliced_elements(parameter) is not None for parameter in body.parameters
    ):
        return "slice copy"
    return "elementwise"


def aliased_operands(instruction: Instruction) -> set[int]:
    """The operands whose buffers `instruction`'s outputs alias whole
    (`output_to_operand_aliasing={{1}: (11, {}), ...}`: operand 11 is output 1)."""
    key = "output_to_operand_aliasing="
    start = instruction.attributes.find(key)
    if start < 0:
        return set()
    start += len(key)
    text = instruction.attributes[start : _balanced_end(instruction.attributes, start) + 1]
    return {int(operand) for operand in re.findall(r"\((\d+), \{\}\)", text)}


def kernel_name(instruction: Instruction) -> str:
    """A custom call's kernel name as its backend config gives it (a Pallas kernel's
    `name`: `name = "decode_attention"` for Triton, `"name": "..."` in JSON configs), or
    empty."""
    found = re.search(r'\bname"?\s*[=:]\s*"([^"]+)"', instruction.attributes)
    return found.group(1) if found else ""


def _access(module: Module, instruction: Instruction, shapes: dict[str, str]) -> Access:
    operand_shapes = [shapes.get(operand, "") for operand in instruction.operands]
    named = {}  # a custom call's kernel name and reads per operand
    if instruction.opcode == "fusion":
        called = _attribute(instruction, "calls")
        body = _FusionBody(module.computations[called])
        read, written = _fusion_traffic(body, operand_shapes)
        kind = _fusion_category(body, _attribute(instruction, "kind"), called)
        flops = body.matmul_flops()
    elif instruction.opcode in _UPDATE_OPERAND:  # in place: the update both ways
        read = written = array_bytes(operand_shapes[_UPDATE_OPERAND[instruction.opcode]])
        kind = "update in place"
        flops = 0
    else:
        aliased = aliased_operands(instruction)
        operand_read = tuple(
            0 if index in aliased else array_bytes(shape)
            for index, shape in enumerate(operand_shapes)
        )
        read = sum(operand_read)
        written = array_bytes(instruction.shape) - sum(
            array_bytes(operand_shapes[index]) for index in aliased if index < len(operand_shapes)
        )
        flops = 0
        target = re.search(r'custom_call_target="([^"]+)"', instruction.attributes)
        if instruction.opcode in ("dot", "convolution") or (
            target and re.search("gemm|matmul|cublas", target.group(1), re.IGNORECASE)
        ):
            kind = "matmul"
            flops = dot_flops(instruction, shapes)
        elif instruction.opcode in ("reduce", "reduce-window"):
            kind = "reduction"
        elif instruction.opcode in _SLICES:
            kind = "slice copy"
        elif instruction.opcode in ("copy", "transpose"):
            kind = "copy"
        else:
            kind = "other"
        if instruction.opcode == "custom-call":
            named = {"kernel": kernel_name(instruction), "operand_read_bytes": operand_read}
    return Access(instruction.name, kind, read, written, instruction.shape, flops, **named)


def with_operand_reads_scaled(
    loop: Loop, kernel: str, operands: tuple[int, ...], share: float
) -> Loop:
    """`loop` with each run of custom-call kernel `kernel` reading `share` of `operands`
    (their indices) where the program gives it whole buffers: a kernel that reads a
    buffer only up to a bound the program does not hold, as the decode-attention kernel
    reads each row's KV cache up to its last visible slot."""

    def scaled(access: Access) -> Access:
        if access.kernel != kernel:
            return access
        reads = tuple(
            round(read * share) if index in operands else read
            for index, read in enumerate(access.operand_read_bytes)
        )
        return dataclasses.replace(access, read_bytes=sum(reads), operand_read_bytes=reads)

    return dataclasses.replace(
        loop,
        accesses=tuple(scaled(access) for access in loop.accesses),
        loops=tuple(
            with_operand_reads_scaled(nested, kernel, operands, share) for nested in loop.loops
        ),
    )


def computation_traffic(module: Module, name: str, trip_count: int | None = 1) -> Loop:
    """The traffic of computation `name` (one execution), its while loops nested."""
    body = module.computations[name]
    shapes = {instruction.name: instruction.shape for instruction in body}
    accesses, loops = [], []
    for instruction in body:
        if instruction.opcode == "while":
            loop_body = _attribute(instruction, "body")
            nested = computation_traffic(module, loop_body, _trip_count(instruction))
            loops.append(dataclasses.replace(nested, name=instruction.name))
        elif instruction.opcode == "call":  # inline: the callee's kernels run here
            called = computation_traffic(module, _attribute(instruction, "to_apply"))
            accesses.extend(called.accesses)
            loops.extend(called.loops)
        elif instruction.opcode not in _FREE:
            accesses.append(_access(module, instruction, shapes))
    return Loop(name, trip_count, tuple(accesses), tuple(loops))


def program_traffic(hlo_text: str) -> Loop:
    """The entry computation's traffic, every while loop nested in it."""
    module = parse_module(hlo_text)
    return computation_traffic(module, module.entry)


def loops_without_trip_count(loop: Loop) -> list[Loop]:
    """The outermost loops whose trip count is not known at compile time (decode loops
    that stop when every row has ended), in program order."""
    found = []
    for nested in loop.loops:
        if nested.trip_count is None:
            found.append(nested)
        else:
            found.extend(loops_without_trip_count(nested))
    return found


def _sum_by_kind(loop: Loop, value: Callable[[Access], float]) -> dict[str, float]:
    """`value` of each access per iteration of `loop`, summed by kind, largest first."""
    totals: dict[str, float] = {}
    for access, times in loop.all_accesses():
        totals[access.kind] = totals.get(access.kind, 0) + value(access) * times
    return dict(sorted(totals.items(), key=lambda item: -item[1]))


def bytes_by_kind(loop: Loop) -> dict[str, int]:
    """Bytes per iteration of `loop`, summed by what the kernels do, largest first."""
    return _sum_by_kind(loop, lambda access: access.bytes)


def seconds_by_kind(loop: Loop, bytes_per_s: float, flops_per_s: float) -> dict[str, float]:
    """Roofline seconds per iteration of `loop`, summed by what the kernels do."""
    return _sum_by_kind(loop, lambda access: access.seconds_at_least(bytes_per_s, flops_per_s))


@dataclasses.dataclass(frozen=True)
class AccessGroup:
    """Kernels of one kind and output shape (a layer's repeats): how many, bytes together."""

    kind: str
    shape: str
    count: int
    bytes: int


def largest_groups(loop: Loop, count: int) -> list[AccessGroup]:
    """The `count` groups of kernels (same kind and output shape) that move the most bytes
    per iteration of `loop`."""
    groups: dict[tuple[str, str], tuple[int, int]] = {}
    for access, times in loop.all_accesses():
        kernels, moved = groups.get((access.kind, access.shape), (0, 0))
        groups[access.kind, access.shape] = (kernels + times, moved + access.bytes * times)
    ranked = sorted(groups.items(), key=lambda item: -item[1][1])[:count]
    return [AccessGroup(kind, shape, kernels, moved) for (kind, shape), (kernels, moved) in ranked]


# The parts of `memory_plan` that add up to what a program needs on its device.
MEMORY_PLAN_PARTS = ("argument_bytes", "temp_bytes", "new_output_bytes")


def memory_plan(compiled) -> dict:
    """XLA's memory plan of a compiled program on one device: its arguments (params,
    state, inputs), its scratch, and the outputs that do not reuse a donated argument
    (bytes, `MEMORY_PLAN_PARTS`); their sum, what the program needs on the device while it
    runs, as `device_gib`. Empty where the backend makes no plan."""
    stats = compiled.memory_analysis()
    if stats is None:
        return {}
    parts = {
        "argument_bytes": stats.argument_size_in_bytes,
        "temp_bytes": stats.temp_size_in_bytes,
        "new_output_bytes": stats.output_size_in_bytes - stats.alias_size_in_bytes,
    }
    return {**parts, "device_gib": round(sum(parts.values()) / 2**30, 2)}
