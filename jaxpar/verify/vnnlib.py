"""VNN-LIB properties (the SMT-LIB subset VNN-COMP writes its specifications in) as arrays.

A property declares the network's inputs ``X_i`` and outputs ``Y_j`` as reals, bounds each input
to a box, and asserts a condition on the outputs. As in VNN-COMP, the asserted output condition is
the UNSAFE set, what a counterexample reaches: the property holds when no input in the box reaches
it. Here that set is a disjunction of conjunctions of linear constraints ``C @ y <= d``, which is
what the bounds can refute: a disjunct is impossible when one of its rows has ``C y - d > 0`` for
every input in the box.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re

import numpy as np

from jaxpar.errors import JaxparError


class PropertyError(JaxparError):
    """A VNN-LIB property that cannot be read as an input box and an unsafe set of output constraints."""


@dataclasses.dataclass(frozen=True, eq=False)
class Property:
    """An input box ``lower <= x <= upper`` (shape (n_inputs,)) and the unsafe set of outputs: the
    union over ``unsafe``'s disjuncts ``(C, d)`` of ``{y : C @ y <= d}`` (C (k, n_outputs), d (k,))."""

    lower: np.ndarray
    upper: np.ndarray
    unsafe: tuple

    def spec(self):
        """(C_all, d_all, groups): every disjunct's rows stacked, and the disjunct each row is from."""
        c_all = np.concatenate([c for c, _ in self.unsafe])
        d_all = np.concatenate([d for _, d in self.unsafe])
        groups = np.repeat(np.arange(len(self.unsafe)), [len(d) for _, d in self.unsafe])
        return c_all, d_all, groups

    def verdict(self, lower_bounds) -> bool:
        """True (verified) when ``lower_bounds`` (lower bounds of ``C_all @ y - d_all`` over the box,
        one per row of ``spec()``) rule out every disjunct: each has a row whose constraint can never
        hold. A NaN bound rules out nothing."""
        _, d_all, groups = self.spec()
        lower_bounds = np.asarray(lower_bounds)
        if lower_bounds.shape != d_all.shape:
            raise PropertyError(f"verdict got bounds of shape {lower_bounds.shape}; it takes one lower bound per row "
                                f"of the property's spec(), shape {d_all.shape}")
        refuted = np.zeros(len(self.unsafe), bool)
        np.logical_or.at(refuted, groups, lower_bounds > 0)
        return bool(refuted.all())


def load_vnnlib(path, n_inputs: int, n_outputs: int) -> Property:
    """The property in the VNN-LIB file at ``path`` for a network of ``n_inputs`` inputs and ``n_outputs`` outputs."""
    if not pathlib.Path(path).is_file():
        raise PropertyError(f"{path}: no such file; give the path of a VNN-LIB property")
    return parse_vnnlib(pathlib.Path(path).read_text(), n_inputs, n_outputs)


def parse_vnnlib(text: str, n_inputs: int, n_outputs: int) -> Property:
    """The property a VNN-LIB ``text`` states, for a network of ``n_inputs`` inputs and ``n_outputs`` outputs."""
    counts = {"X": n_inputs, "Y": n_outputs}
    declared, lower, upper = set(), np.full(n_inputs, -np.inf), np.full(n_inputs, np.inf)
    disjuncts = [[]]  # the unsafe set so far: a disjunction of conjunctions of output rows
    for form in _read_forms(text):
        head = form[0] if form else None
        if head == "declare-const":
            declared.add(_declaration(form, counts))
        elif head == "assert" and len(form) == 2:
            for clause in _conjuncts(form[1]):
                if isinstance(clause, list) and clause and clause[0] == "or":
                    alternatives = [_output_disjunct(term, declared, counts) for term in clause[1:]]
                    if not alternatives:
                        raise PropertyError(f"VNN-LIB {_show(clause)} has no alternatives; give it at least one")
                    disjuncts = [rows + more for rows in disjuncts for more in alternatives]
                    continue
                coefficients, constant = _constraint(clause, declared, counts)
                if any(kind == "X" for kind, _ in coefficients):
                    _bound_input(clause, coefficients, constant, lower, upper)
                else:
                    disjuncts = [rows + [(coefficients, constant)] for rows in disjuncts]
        elif head not in ("set-logic", "check-sat", "get-model", "exit"):  # commands that state nothing
            raise PropertyError(f"VNN-LIB {_show(form)} is not a declaration or an assertion; VNN-LIB properties are "
                                "(declare-const X_i Real) and (assert ...) forms")
    _check_box(lower, upper)
    return Property(_round_outward(lower, -np.inf), _round_outward(upper, np.inf),
                    tuple(_rows(rows, n_outputs) for rows in disjuncts))


_TOKEN = re.compile(r"\(|\)|[^\s()]+")
_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")
_VARIABLE = re.compile(r"([XY])_(\d+)")
_COMPARISONS = ("<=", "<", ">=", ">")


def _quote(text: str, position: int) -> str:
    bit = " ".join(text[position:position + 60].split())
    return repr(bit + ("..." if len(text) > position + 60 else ""))


def _show(form) -> str:
    """A parsed form as the text it was read from (shortened), for messages."""
    text = form if isinstance(form, str) else "(" + " ".join(_show(part) for part in form) + ")"
    return text if len(text) <= 80 else text[:77] + "..."


def _read_forms(text: str) -> list:
    """The top-level s-expressions of ``text`` as nested lists of tokens (``;`` comments dropped)."""
    uncommented = re.sub(r";[^\n]*", lambda match: " " * len(match.group()), text)  # keeps positions for messages
    stack, starts = [[]], []
    for match in _TOKEN.finditer(uncommented):
        token = match.group()
        if token == "(":
            stack.append([])
            starts.append(match.start())
        elif token == ")":
            if len(stack) == 1:
                raise PropertyError(f"VNN-LIB text has a ')' that closes nothing at {_quote(text, match.start())}; "
                                    "remove it or open its '('")
            form = stack.pop()
            starts.pop()
            stack[-1].append(form)
        elif len(stack) == 1:
            raise PropertyError(f"VNN-LIB text has {token!r} outside any form at {_quote(text, match.start())}; "
                                "every statement is a parenthesised form")
        else:
            stack[-1].append(token)
    if len(stack) > 1:
        raise PropertyError(f"VNN-LIB text has a '(' that is never closed at {_quote(text, starts[-1])}; close it with ')'")
    return stack[0]


def _variable(token: str, counts: dict):
    """A variable's (kind, index): ``X_i`` an input, ``Y_j`` an output, within the network's counts."""
    match = _VARIABLE.fullmatch(token)
    if match is None:
        raise PropertyError(f"VNN-LIB names a variable {token!r}; VNN-LIB names the inputs X_0, X_1, ... and the "
                            "outputs Y_0, Y_1, ...")
    kind, index = match.group(1), int(match.group(2))
    if index >= counts[kind]:
        what = "inputs" if kind == "X" else "outputs"
        raise PropertyError(f"VNN-LIB names {token}, but the network has {counts[kind]} {what} ({kind}_0 to "
                            f"{kind}_{counts[kind] - 1}); check the property is for this network")
    return kind, index


def _declaration(form, counts: dict) -> str:
    if len(form) != 3 or not isinstance(form[1], str) or form[2] != "Real":
        raise PropertyError(f"VNN-LIB {_show(form)} is not a declaration VNN-LIB makes; write (declare-const X_0 Real)")
    _variable(form[1], counts)
    return form[1]


def _conjuncts(term) -> list:
    """``term``'s conjuncts: the terms an ``and`` (nested or not) joins, else the term itself."""
    if isinstance(term, list) and term and term[0] == "and":
        return [clause for part in term[1:] for clause in _conjuncts(part)]
    return [term]


def _linear(term, declared: set, counts: dict):
    """A linear term as ({(kind, index): coefficient}, constant)."""
    if isinstance(term, str):
        if _NUMBER.fullmatch(term):
            return {}, float(term)
        variable = _variable(term, counts)
        if term not in declared:
            raise PropertyError(f"VNN-LIB uses {term} before declaring it; add (declare-const {term} Real) above")
        return {variable: 1.0}, 0.0
    if not term or not isinstance(term[0], str) or term[0] not in ("+", "-", "*"):
        raise PropertyError(f"VNN-LIB term {_show(term)} is not a linear term; write sums (+ a b), differences (- a b) "
                            "and products by a number (* 2.0 Y_0) of variables and numbers")
    parts = [_linear(part, declared, counts) for part in term[1:]]
    if not parts:
        raise PropertyError(f"VNN-LIB term {_show(term)} has no operands; give it at least one")
    if term[0] == "*":
        variables = [part for part in parts if part[0]]
        if len(variables) > 1:
            raise PropertyError(f"VNN-LIB term {_show(term)} multiplies variables together; jaxpar.verify reads linear "
                                "constraints: multiply variables by numbers only")
        factor = np.prod([constant for coefficients, constant in parts if not coefficients])
        coefficients, constant = variables[0] if variables else ({}, 1.0)
        return {key: factor * value for key, value in coefficients.items()}, factor * constant
    signs = [-1.0] if term[0] == "-" and len(parts) == 1 else [1.0] + [-1.0 if term[0] == "-" else 1.0] * (len(parts) - 1)
    total = {}
    for sign, (coefficients, _) in zip(signs, parts):
        for key, value in coefficients.items():
            total[key] = total.get(key, 0.0) + sign * value
    return total, sum(sign * constant for sign, (_, constant) in zip(signs, parts))


def _constraint(term, declared: set, counts: dict):
    """A comparison as ``sum(coefficient * variable) + constant <= 0``: ({(kind, index): coefficient},
    constant). A strict ``<`` reads as ``<=``: the unsafe set grows by its boundary, so a property
    verified with it holds for the strict one too (sound for verification)."""
    if not isinstance(term, list) or len(term) != 3 or term[0] not in _COMPARISONS:
        raise PropertyError(f"VNN-LIB {_show(term)} is not a comparison jaxpar.verify reads; write (<= a b), (>= a b), "
                            "(< a b) or (> a b) of linear terms, joined by and / or")
    (left, left_constant), (right, right_constant) = (_linear(side, declared, counts) for side in term[1:])
    if term[0] in (">=", ">"):
        (left, left_constant), (right, right_constant) = (right, right_constant), (left, left_constant)
    coefficients = dict(left)
    for key, value in right.items():
        coefficients[key] = coefficients.get(key, 0.0) - value
    coefficients = {key: value for key, value in coefficients.items() if value != 0}
    kinds = {kind for kind, _ in coefficients}
    if not coefficients:
        raise PropertyError(f"VNN-LIB {_show(term)} compares numbers only; every constraint must name a variable")
    if kinds == {"X", "Y"}:
        raise PropertyError(f"VNN-LIB {_show(term)} mixes inputs and outputs; constrain the inputs (a box) and the "
                            "outputs separately")
    return coefficients, left_constant - right_constant


def _bound_input(term, coefficients: dict, constant: float, lower, upper):
    """An input constraint ``a * X_i + constant <= 0`` as a bound on X_i (the tightest given wins)."""
    if len(coefficients) != 1:
        raise PropertyError(f"VNN-LIB {_show(term)} constrains several inputs together; jaxpar.verify reads input "
                            "sets that are boxes: bound each X_i on its own")
    ((_, index), factor), = coefficients.items()
    value = -constant / factor
    if factor > 0:
        upper[index] = min(upper[index], value)
    else:
        lower[index] = max(lower[index], value)


def _output_disjunct(term, declared: set, counts: dict) -> list:
    """One alternative of an ``or``: a conjunction of output constraints."""
    rows = []
    for clause in _conjuncts(term):
        coefficients, constant = _constraint(clause, declared, counts)
        if any(kind == "X" for kind, _ in coefficients):
            raise PropertyError(f"VNN-LIB {_show(term)} is an alternative of an (or ...) that constrains the inputs: a "
                                "disjunction over input boxes, which jaxpar.verify does not support; split the property "
                                "into one file per input box")
        rows.append((coefficients, constant))
    return rows


def _check_box(lower, upper):
    for index, (low, high) in enumerate(zip(lower, upper)):
        if not (np.isfinite(low) and np.isfinite(high)):
            missing = " and ".join(side for side, value in (("lower", low), ("upper", high)) if not np.isfinite(value))
            raise PropertyError(f"VNN-LIB gives X_{index} no {missing} bound; bound every input, e.g. "
                                f"(assert (>= X_{index} -1.0)) and (assert (<= X_{index} 1.0))")
        if low > high:
            raise PropertyError(f"VNN-LIB bounds X_{index} below by {low} and above by {high}: an empty box; "
                                f"swap the two bounds of X_{index}")


def _round_outward(values, direction) -> np.ndarray:
    """``values`` as float32, each rounded towards ``direction`` where float32 cannot hold it exactly:
    the float32 box (and unsafe set) then contains the one written, so a verdict on it is sound."""
    rounded = values.astype(np.float32)
    inward = rounded < values if direction > 0 else rounded > values
    return np.where(inward, np.nextafter(rounded, np.float32(direction)), rounded).astype(np.float32)


def _rows(rows: list, n_outputs: int):
    """A conjunction of output constraints as (C, d): ``C @ y <= d``, d rounded up (a larger unsafe set)."""
    c = np.zeros((len(rows), n_outputs), np.float32)
    d = np.zeros(len(rows))
    for row, (coefficients, constant) in enumerate(rows):
        for (_, index), value in coefficients.items():
            c[row, index] = value
        d[row] = -constant
    return c, _round_outward(d, np.inf)
