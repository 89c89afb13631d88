"""The tool group: CPU actors that run the policy's tool calls, each in a sandbox.

A tool is a built-in (`calculator`: the arithmetic task's notation, evaluated as its
solutions are; `python`: the call's text run as a program, as the code checker runs one,
its standard output the tool's) or a user's function, ``path/to/file.py:function`` or
``package.module:function``, which takes the call's text and returns the output's: the same
seam as a user's checker (`rayrep.verifier.checkers`), loaded and run in the same sandbox
child, under the same hard limits (a wall-clock limit per call, an address-space limit;
`python` runs under the code checker's limits besides). A call that raises, gives no text or
overruns answers the policy with what went wrong, counted as a tool error or time-out, never
the run's end.

The generators call the tool actors themselves, as their answers reach a call
(`rayrep.generator.turns.ActorTools`), and go on decoding meanwhile. A tool actor that dies
loses its call, which the generator asks once more of the next actor, then scores its answer
as a tool failure; the group replaces dead actors between steps (`replace_dead`).
"""

from __future__ import annotations

import os

import ray

from rayrep.cluster.placement import Placement
from rayrep.cluster.supervisor import Supervisor, responds
from rayrep.config import Config
from rayrep.config.schema import TOOLS
from rayrep.errors import InputError
from rayrep.generator.turns import ToolResult
from rayrep.models.tool_format import ToolFormat
from rayrep.library_output import route_library_output
from rayrep.verifier.checkers import TOOL_ARGUMENTS, CheckerError, Plugin, plugin
from rayrep.verifier.code import CodeLimits
from rayrep.verifier.sandbox import MathSandbox, SandboxError


def tool_plugins(name: str) -> tuple[Plugin, ...]:
    """The user's tool `name` names (its file read), or none for a built-in."""
    return () if name in TOOLS else (plugin(name, takes=TOOL_ARGUMENTS),)


class ToolSandbox:
    """Runs calls of one tool in a sandbox child (a tool actor's, or this process's)."""

    def __init__(self, name: str, timeout_s: float, code: CodeLimits, plugins: tuple[Plugin, ...] = ()):
        self.name = name
        # A `python` call's program runs under its own limits, inside the child's per-call one.
        self.limit_s = max(timeout_s, code.wall_s + 1.0) if name == "python" else timeout_s
        self.sandbox = MathSandbox(plugins=plugins, code_limits=code).start()

    def run(self, calls: list[str]) -> list[ToolResult]:
        import time

        results = []
        for call in calls:  # one at a time: each its own time
            start = time.perf_counter()
            (verdict,) = self.sandbox.tool_batch([(self.name, call)], self.limit_s)
            output = verdict.answer if verdict.answer is not None else f"error: {verdict.detail}"
            results.append(ToolResult(output, verdict.status, time.perf_counter() - start))
        return results

    def close(self) -> None:
        self.sandbox.close()


class ToolWorker(ToolSandbox):
    # A sync actor: its calls run one at a time on the main thread, as the sandbox needs.
    def __init__(self, name: str, timeout_s: float, code: CodeLimits, plugins: tuple[Plugin, ...] = ()):
        route_library_output()
        super().__init__(name, timeout_s, code, plugins)

    def pid(self) -> int:
        """The actor's process id; answering at all shows that the actor is alive."""
        return os.getpid()


RemoteToolWorker = ray.remote(ToolWorker)


def check_tools(cfg: Config, tokenizer, policy: str = "the policy") -> ToolFormat | None:
    """The run's tool settings, before any actor starts: the policy's chat template frames a
    tool message (`ToolFormat.of`), a turn fits the response budget, and a user's tool loads
    in a sandbox child as the tool actors load it (its file read, it imports, its function
    takes the call's text). InputError (CheckerError for the tool) naming what is wrong;
    returns the format (None: no tool)."""
    tools = cfg.tools
    if not tools.enabled:
        return None
    format = ToolFormat.of(tokenizer, tools.call_start, tools.call_end, tools.max_output_chars, name=policy)
    framing = format.framing_tokens(tokenizer)
    budget = cfg.generator.max_response_tokens
    if budget <= framing:
        raise InputError(f"generator.max_response_tokens={budget} is smaller than one turn with a tool: the framing of "
                         f"a tool's output alone takes {framing} tokens of the answer's budget")
    plugins = tool_plugins(tools.name)
    if plugins:
        sandbox = MathSandbox(plugins=plugins, keep_spare=False)
        try:
            sandbox.start()
        except SandboxError as err:
            raise CheckerError(str(err)) from None
        finally:
            sandbox.close()
    return format


class ToolGroup:
    """The tool actors of a run whose answers call a tool (`tools.name`), each in its bundle."""

    def __init__(self, cfg: Config, placement: Placement | None = None):
        tools = cfg.tools
        plugins = tool_plugins(tools.name)
        code = CodeLimits.of(cfg.verifier)

        def start(slot: int):
            options = placement.options("tool", slot) if placement else {"num_cpus": 0.25}
            return RemoteToolWorker.options(**options).remote(tools.name, tools.timeout_s, code, plugins)

        self.supervisor = Supervisor("tool", [start(i) for i in range(tools.num_workers)], start)
        self.workers = self.supervisor.workers
        ray.get([worker.pid.remote() for worker in self.workers])  # (a sandbox that cannot start fails here)

    def replace_dead(self) -> int:
        """Start a new actor for each that no longer answers (its calls were retried or
        failed meanwhile); returns how many."""
        replaced = 0
        for slot, worker in enumerate(self.workers):
            if not responds(worker):
                replaced += self.supervisor.replace(slot, RuntimeError("it no longer answers"))
        return replaced

    def shutdown(self) -> None:
        for worker in self.workers:
            try:
                ray.get(worker.close.remote())
            except ray.exceptions.RayActorError:
                pass
