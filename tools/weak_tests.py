"""Lists tests that may be unable to fail, by reading their source (AST).

    python tools/weak_tests.py [test/ ...]

Three lists, each for a reader to judge (a flag is a question, not a bug):

* *no check*: a ``test_*`` function with no ``assert``, no ``pytest.raises``
  / ``warns`` / ``fail`` / ``approx``, and no call of a helper that has
  one (helpers are searched in the same module and in test/helpers.py,
  through helpers calling helpers; matched by name);
* *weak checks only*: every assert is ``assert x``, ``assert x is not
  None`` or ``assert isinstance(...)``: true of almost anything;
* *skips*: ``pytest.skip``, ``pytest.xfail``, ``pytest.importorskip`` and
  the skip / xfail marks, which can turn a failure into green.

Exit status 1 if the first two lists are not empty.  tools/mutants.py is the
other half: it breaks the code and sees which tests notice.
"""
import ast
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECKS = {"raises", "warns", "fail", "approx", "deprecated_call"}
SKIPS = {"skip", "xfail", "importorskip", "skipif"}


def _called_names(node) -> set:
    out = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Call):
            f = n.func
            out.add(f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None))
    return out - {None}


def _has_own_check(node) -> bool:
    return any(isinstance(n, ast.Assert) for n in ast.walk(node)) or bool(
        _called_names(node) & CHECKS)


def _checking_functions(trees) -> set:
    """Names of the functions (in ``trees``) that check something, directly
    or through another such function."""
    funcs = {n.name: n for tree in trees for n in ast.walk(tree)
             if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    checking = {name for name, f in funcs.items() if _has_own_check(f)}
    grew = True
    while grew:
        grew = False
        for name, f in funcs.items():
            if name not in checking and _called_names(f) & checking:
                checking.add(name)
                grew = True
    return checking


def _weak(test) -> bool:
    asserts = [n for n in ast.walk(test) if isinstance(n, ast.Assert)]
    if not asserts or _called_names(test) & CHECKS:
        return False

    def weak(expr):
        if isinstance(expr, (ast.Name, ast.Attribute)):
            return True
        if (isinstance(expr, ast.Compare) and len(expr.ops) == 1
                and isinstance(expr.ops[0], ast.IsNot)
                and isinstance(expr.comparators[0], ast.Constant)
                and expr.comparators[0].value is None):
            return True
        return isinstance(expr, ast.Call) and getattr(expr.func, "id", "") == "isinstance"

    return all(weak(a.test) for a in asserts)


def _skips(tree) -> list:
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute) and n.attr in SKIPS:
            out.append(n.lineno)
    return sorted(set(out))


def scan(paths) -> dict:
    files = []
    for p in paths:
        if os.path.isdir(p):
            for d, _, names in os.walk(p):
                files += [os.path.join(d, n) for n in names if n.endswith(".py")]
        else:
            files.append(p)
    helpers = []  # the test folder's modules that are no test files
    for d, _, names in os.walk(os.path.join(ROOT, "test")):
        for name in names:
            if name.endswith(".py") and not name.startswith("test_"):
                with open(os.path.join(d, name)) as f:
                    helpers.append(ast.parse(f.read()))
    found = {"no check": [], "weak checks only": [], "skips": []}
    for path in sorted(files):
        with open(path) as f:
            tree = ast.parse(f.read())
        checking = _checking_functions([tree, *helpers])
        rel = os.path.relpath(path, ROOT)
        for n in ast.walk(tree):
            if not (isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                    and n.name.startswith("test")):
                continue
            where = f"{rel}:{n.lineno} {n.name}"
            if not _has_own_check(n) and not (_called_names(n) & checking):
                found["no check"].append(where)
            elif _weak(n):
                found["weak checks only"].append(where)
        found["skips"] += [f"{rel}:{line}" for line in _skips(tree)]
    return found


def main() -> int:
    paths = sys.argv[1:] or [os.path.join(ROOT, "test")]
    found = scan(paths)
    for kind, items in found.items():
        print(f"{kind}: {len(items)}")
        for item in items:
            print(f"  {item}")
    return 1 if found["no check"] or found["weak checks only"] else 0


if __name__ == "__main__":
    sys.exit(main())
