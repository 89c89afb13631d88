"""The harness that runs a model's program in the code checker's sandboxed process.

Copied into the run's fresh folder and started there as ``python -I -S harness.py MODE`` by
`rayrep.verifier.code`, with the limits already applied to the process; standard library
only. This is the one file of rayrep that runs untrusted code on purpose (the audit in
tests/test_safety.py names it). It reads a one-time token from the file `token` and removes
it before the program runs, and prints ``<token> <passed> <total>`` as its last line once
the tests ran, so that a program that merely exits early, or prints, reports nothing.

Modes: ``script`` runs solution.py as ``__main__`` (stdin/stdout cases: the parent
compares the output); ``asserts`` runs solution.py, then each statement of tests.json in its
namespace; ``call`` runs solution.py, then calls the function tests.json names on each
argument list and compares the result with the expected one.
"""

import json
import os
import runpy
import sys


def _refuse_sockets() -> None:
    """Where the process has no network namespace of its own: sockets refused in Python
    (not a boundary: code that reaches the system calls another way is not stopped)."""
    import socket

    def refused(*args, **kwargs):
        raise PermissionError("network access is refused in the code sandbox")

    socket.socket = refused
    socket.create_connection = refused
    socket.socketpair = refused


def _same(result, expected) -> bool:
    """Equal, with tuples and lists alike (tests read from JSON have lists)."""
    try:
        return json.loads(json.dumps(result)) == expected
    except (TypeError, ValueError):
        return result == expected


def main() -> None:
    mode, guard = sys.argv[1], sys.argv[2] == "guard"
    with open("token") as file:
        token = file.read()
    os.remove("token")
    if guard:
        _refuse_sockets()
    sys.path.insert(0, os.getcwd())
    if mode == "script":
        runpy.run_path("solution.py", run_name="__main__")
        return
    with open("tests.json") as file:
        tests = json.load(file)
    namespace = runpy.run_path("solution.py", run_name="solution")
    passed = 0
    if mode == "asserts":
        for index, statement in enumerate(tests):
            try:
                exec(compile(statement, f"<test {index + 1}>", "exec"), namespace)
                passed += 1
            except Exception:
                pass
        total = len(tests)
    else:
        function = namespace.get(tests["fn_name"])
        for arguments, expected in zip(tests["inputs"], tests["outputs"]):
            try:
                passed += callable(function) and _same(function(*arguments), expected)
            except Exception:
                pass
        total = len(tests["inputs"])
    sys.stdout.flush()
    print(f"\n{token} {passed} {total}", flush=True)


if __name__ == "__main__":
    main()
