"""Runs README code blocks in this process and checks what their comments
say (test_readme.py starts one fresh process per block).

    python readme_runner.py BLOCK.json

BLOCK.json: ``{"source", "prelude", "fill", "check", "text"}``.  The prelude
runs first, in the block's namespace; a line of the block that is ``...``
alone (the README's "your code here") is replaced by ``fill``, one line, so
line numbers stay; ``check`` runs last.  The block is compiled as
``train.py`` (the file name the README's messages show), one top-level
statement at a time, and each single-line statement is held to its
trailing comment:

* ``expr  # True`` (a comment that is a Python literal): ``expr`` evaluates
  to it;
* ``stmt  # DonatedBufferError, ...`` (an exception class's name): ``stmt``
  raises it, and the comment lines right under it are its message;
* ``print(x)  # text``: the line printed is ``text``;
* any other comment is prose.

In expected text, ``...`` stands for anything, and runs of white space
match any white space.  ``text`` (a ``text`` block right after the code
block in the README) is what the whole block prints.  The package's
warnings are errors: a README block that warns says nothing about it.
Exits non-zero with the reason on the first claim that does not hold.
"""
import ast
import builtins
import contextlib
import io
import json
import re
import sys
import tokenize
import warnings

FILENAME = "train.py"


class ClaimFailed(AssertionError):
    pass


def matches(pattern: str, text: str) -> bool:
    """``...`` in ``pattern`` is a wildcard; white space is normalized.

    >>> matches("reused by step 2 ...>", "reused by step 2 (at train.py:10); gone>")
    True
    >>> matches("reused by step 3 ...>", "reused by step 2 (at train.py:10); gone>")
    False
    """
    def norm(s):
        return " ".join(s.split())

    parts = [re.escape(p) for p in norm(pattern).split("...")]
    return re.fullmatch(".*?".join(parts), norm(text), flags=re.S) is not None


def comments_by_line(source: str) -> dict:
    """{line number: comment text without ``#``}; and the comment-only lines."""
    comments, code_lines = {}, set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string[1:].strip()
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                              tokenize.ENDMARKER):
            code_lines.add(tok.start[0])
    only = {n for n in comments if n not in code_lines}
    return comments, only


def fill_ellipses(source: str, fill: str | None) -> str:
    lines = source.splitlines()
    for i, line in enumerate(lines):
        code = line.split("#", 1)[0].strip()
        if code == "...":
            if fill is None:
                raise ClaimFailed(f"line {i + 1} is `...` and the block's setup gives no fill")
            assert "\n" not in fill.strip(), "a fill is one line: line numbers must stay"
            indent = line[: len(line) - len(line.lstrip())]
            lines[i] = indent + fill.strip()
    return "\n".join(lines) + "\n"


def _exception_named(comment: str, ns: dict):
    m = re.match(r"([A-Za-z_]\w*(?:Error|Exception|Warning))\b", comment)
    if not m:
        return None
    name = m.group(1)
    tdx = sys.modules.get("torch_xla_donate")
    found = ns.get(name, getattr(builtins, name, None) or getattr(tdx, name, None))
    if not (isinstance(found, type) and issubclass(found, BaseException)):
        raise ClaimFailed(f"the comment names {name}, which is no exception class here")
    return found


def _literal(comment: str):
    try:
        return True, ast.literal_eval(comment)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return False, None


def _message_under(line: int, comments: dict, only: set) -> str:
    lines, n = [], line + 1
    while n in only:
        lines.append(comments[n])
        n += 1
    return " ".join(lines)


def run_statement(stmt, source_lines, comments, only, ns, out) -> None:
    code = compile(ast.Module(body=[stmt], type_ignores=[]), FILENAME, "exec")
    comment = comments.get(stmt.lineno) if stmt.lineno == stmt.end_lineno else None
    where = f"{FILENAME}:{stmt.lineno} `{source_lines[stmt.lineno - 1].split('#')[0].strip()}`"
    expected_exc = _exception_named(comment, ns) if comment else None
    if expected_exc is not None:
        try:
            exec(code, ns)
        except expected_exc as e:
            message = _message_under(stmt.lineno, comments, only)
            if message and not matches(message, str(e)):
                raise ClaimFailed(f"{where}: the README says the message is\n  {message}\n"
                                  f"it is\n  {e}") from None
            out.write(f"[{type(e).__name__}: {e}]\n")
            return
        raise ClaimFailed(f"{where}: the README says it raises {expected_exc.__name__}; it did not")
    is_expr = isinstance(stmt, ast.Expr)
    is_print = (is_expr and isinstance(stmt.value, ast.Call)
                and isinstance(stmt.value.func, ast.Name) and stmt.value.func.id == "print")
    if comment and is_print:
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(code, ns)
        out.write(printed.getvalue())
        if not matches(comment, printed.getvalue().rstrip("\n")):
            raise ClaimFailed(f"{where}: the README says it prints\n  {comment}\nit printed\n  "
                              f"{printed.getvalue().rstrip()}")
        return
    is_literal, value = _literal(comment) if (comment and is_expr) else (False, None)
    if is_literal:
        got = eval(compile(ast.Expression(stmt.value), FILENAME, "eval"), ns)
        if not (type(got) is type(value) and got == value):
            raise ClaimFailed(f"{where}: the README says {comment}; it is {got!r}")
        return
    exec(code, ns)


def run_block(block: dict) -> str:
    """Runs one block; returns what it printed.  Raises ClaimFailed."""
    import torch_xla_donate as tdx

    for category in (tdx.UnusedDonationWarning, tdx.DroppedDonationWarning, tdx.StaleReadWarning,
                     tdx.DonationDisabledWarning):
        warnings.simplefilter("error", category)
    ns = {"__name__": "__main__"}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        if block.get("prelude"):
            exec(compile(block["prelude"], "<readme-test setup>", "exec"), ns)
    source = fill_ellipses(block["source"], block.get("fill"))
    comments, only = comments_by_line(source)
    lines = source.splitlines()
    for stmt in ast.parse(source, FILENAME).body:
        with contextlib.redirect_stdout(out):
            run_statement(stmt, lines, comments, only, ns, out)
    if block.get("check"):
        with contextlib.redirect_stdout(out):
            exec(compile(block["check"], "<readme-test check>", "exec"), ns)
    printed = out.getvalue()
    if block.get("text") is not None and not matches(block["text"], printed):
        raise ClaimFailed(f"the README's text block says it prints\n{block['text']}\nit printed\n"
                          f"{printed}")
    return printed


def main(path: str) -> int:
    with open(path) as f:
        block = json.load(f)
    try:
        printed = run_block(block)
    except ClaimFailed as e:
        print(f"README CLAIM FAILED: {e}", file=sys.stderr)
        return 3
    sys.stdout.write(printed)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
