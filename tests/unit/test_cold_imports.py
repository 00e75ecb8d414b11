"""What a cold start imports: every Lambda handler, `fed --help` and `fed-participant --help`, each imported in a
fresh interpreter, must not pull in a heavy library it does not need.

A guard on *what* is imported, not on time (tests assert no timings): a heavy package costs its import on every cold
start whatever the machine, and the list of imported modules does not drift with load. `make bench-cold`
(benchmarks/cold_imports.py) measures the times. The handlers are found by reading functions/*.py (a module-level
`handler`), and every handler the CDK code names (infra/*.py) must be among them, so a new function is checked
without editing this file.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Top-level packages no cold start may import, with why each is heavy or unneeded there.
HEAVY: dict[str, str] = {
    "ml_dtypes": "~1.5 s cold; only bfloat16 tensors need it (shared.wire.bfloat16 imports it on first use)",
    "torch": "seconds to import; the participant's training needs it, never the coordinator",
    "transformers": "seconds to import (and torch); only the Hugging Face task's participant",
    "peft": "imports transformers and torch; only the Hugging Face task's participant",
    "matplotlib": "~0.5 s; only `fed plot` draws",
    "rich": "the CLI's console (~0.1 s); a Lambda handler prints nothing",
    "aws_xray_sdk": "0.15-0.18 s; the functions do not trace and their asset does not ship it (moto brings it here)",
    "sklearn": "~1 s with scipy; the digits task reads its CSV without it",
    "scipy": "~0.5 s; nothing on a cold path computes with it",
    "pandas": "~0.5 s; nothing on a cold path uses data frames",
    "moto": "the local stack's AWS stand-in (seconds); never deployed",
    "typer": "the CLI framework (with rich); a Lambda handler has no command line",
}
CLI_OWN = frozenset({"rich", "typer"})  # what a CLI's help is drawn with


def _forbidden(allowed: frozenset[str] = frozenset()) -> set[str]:
    return set(HEAVY) - allowed


def _defines_handler(path: Path) -> bool:
    """Whether the module binds `handler` at module level (a def, or an assignment such as
    `handler = lambda_handler(work)`)."""
    for node in ast.parse(path.read_text(), filename=str(path)).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == "handler":
            return True
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "handler" for t in targets):
                return True
    return False


def handler_modules() -> list[str]:
    """functions.<name> for every functions/<name>.py with a module-level `handler`."""
    return sorted(f"functions.{p.stem}" for p in (ROOT / "functions").glob("*.py")
                  if p.stem != "__init__" and _defines_handler(p))


_HANDLER_STRING = re.compile(r"functions\.(\w+)\.handler")


def _string_args(tree: ast.AST, function: str, index: int) -> set[str]:
    """The string literals passed as positional argument `index` to every call of `function`."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == function:
            arg = node.args[index] if len(node.args) > index else None
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                found.add(arg.value)
    return found


def deployed_handlers() -> set[str]:
    """functions.<name> for every handler string infra/*.py gives a Lambda: a literal "functions.x.handler", or an
    f-string f"functions.{v}.handler" where `v` is a module-level string constant or a parameter of the enclosing
    function (then: the literals every call of that function passes for it). A form this cannot resolve fails,
    so a new way of naming handlers is not silently skipped."""
    names: set[str] = set()
    for path in sorted((ROOT / "infra").glob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        constants = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
                     and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
                     for t in n.targets if isinstance(t, ast.Name)}
        parents = {child: parent for parent in ast.walk(tree) for child in ast.iter_child_nodes(parent)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and not isinstance(
                    parents.get(node), ast.JoinedStr):
                names.update(_HANDLER_STRING.findall(node.value))
            if not isinstance(node, ast.JoinedStr):
                continue
            parts = node.values
            if not (len(parts) == 3 and isinstance(parts[0], ast.Constant) and parts[0].value == "functions."
                    and isinstance(parts[2], ast.Constant) and parts[2].value == ".handler"):
                text = "".join(p.value for p in parts if isinstance(p, ast.Constant) and isinstance(p.value, str))
                assert "functions." not in text or ".handler" not in text, (
                    f"{path.name}:{node.lineno}: a handler string this test cannot read; extend deployed_handlers")
                continue
            value = parts[1]
            assert isinstance(value, ast.FormattedValue) and isinstance(value.value, ast.Name), (
                f"{path.name}:{node.lineno}: a handler f-string this test cannot read; extend deployed_handlers")
            var = value.value.id
            if var in constants:
                names.add(constants[var])
                continue
            scope = parents.get(node)
            while scope is not None and not isinstance(scope, ast.FunctionDef):
                scope = parents.get(scope)
            assert isinstance(scope, ast.FunctionDef), f"{path.name}:{node.lineno}: which handler is {var!r}?"
            params = [a.arg for a in scope.args.args]
            assert var in params, f"{path.name}:{node.lineno}: cannot tell which handler {var!r} names"
            passed = _string_args(tree, scope.name, params.index(var))
            assert passed, f"{path.name}:{node.lineno}: no call of {scope.name} names a handler"
            names.update(passed)
    return {f"functions.{n}" for n in names}


def _cold_modules(code: str) -> dict[str, object]:
    """Run `code` in a fresh interpreter (as a deployed function or an operator's shell would: none of the test
    session's access-check variables) and return the JSON it prints last: {"modules": [...], ...}."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FED_ACCESS")}
    env["COLUMNS"] = "100"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, f"the cold import failed:\n{out.stderr[-3000:]}"
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def _offending(modules: list[str], forbidden: set[str]) -> list[str]:
    return sorted(m for m in modules if m.split(".")[0] in forbidden)


def _fail_on_heavy(what: str, modules: list[str], forbidden: set[str]) -> None:
    offending = _offending(modules, forbidden)
    if offending:
        packages = sorted({m.split(".")[0] for m in offending})
        reasons = "\n".join(f"  {p}: {HEAVY[p]}" for p in packages)
        pytest.fail(f"{what} imports {', '.join(packages)} cold ({len(offending)} modules: "
                    f"{', '.join(offending[:12])}{', ...' if len(offending) > 12 else ''}).\n{reasons}\n"
                    f"Find who imports it: python -X importtime -c ... 2>&1 | grep -B5 {packages[0]}",
                    pytrace=False)


HANDLERS = handler_modules()


def test_every_deployed_handler_is_one_the_guard_finds() -> None:
    deployed = deployed_handlers()
    assert {"functions.tick", "functions.credentials"} <= deployed  # the two ways infra/ names them are read
    missing = deployed - set(HANDLERS)
    assert not missing, f"infra/ deploys handlers this guard does not find in functions/: {sorted(missing)}"


@pytest.mark.parametrize("module", HANDLERS)
def test_a_lambda_handler_imports_nothing_heavy_cold(module: str) -> None:
    result = _cold_modules(f"import json, sys, {module}\n"
                           f"assert callable({module}.handler)\n"
                           "print(json.dumps({'modules': sorted(sys.modules)}))")
    modules = result["modules"]
    assert isinstance(modules, list) and module in modules  # the listing is of the import that ran
    _fail_on_heavy(f"the Lambda handler {module}.handler", modules, _forbidden())


_HELP = """
import contextlib, io, json, sys
from {module} import app
buffer = io.StringIO()
with contextlib.redirect_stdout(buffer):
    try:
        code = app(["--help"], prog_name="{prog}", standalone_mode=False)
    except SystemExit as exit:
        code = exit.code
print(json.dumps({{"modules": sorted(sys.modules), "code": code, "help": buffer.getvalue()}}))
"""


@pytest.mark.parametrize(("prog", "module", "allowed"), [
    ("fed", "fed.cli", CLI_OWN),
    # torch too is forbidden here: the help does not need it (the training imports it when it starts)
    ("fed-participant", "participant.cli", CLI_OWN),
])
def test_a_cli_help_imports_nothing_heavy_cold(prog: str, module: str, allowed: frozenset[str]) -> None:
    result = _cold_modules(_HELP.format(module=module, prog=prog))
    assert result["code"] in (0, None)
    assert f"Usage: {prog}" in str(result["help"])  # the help was drawn: its imports are in the listing
    modules = result["modules"]
    assert isinstance(modules, list)
    _fail_on_heavy(f"`{prog} --help`", modules, _forbidden(allowed))
